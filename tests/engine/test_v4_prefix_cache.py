"""DeepSeek-V4 prefix caching (engine/sched/block_manager.py, attention_v4/pool_layout.py): a hit restores the
compressed blocks, the window tail and the CSA compressors' state at a boundary where every window is closed, so outputs
with and without prefix caching are equal (greedy, float32) for prompts sharing prefixes that end mid-window and at window
boundaries, for a prompt continuing another's output (state written during decode), with DBO splitting chunks, and
through 120 requests under KV pressure (preemption, eviction of cached blocks) where every output equals the request
run alone and no pool leaks a block."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from tests.oracle_v4 import PRO, make_v4_model

V4 = dict(dtype="float32", progress=False)
_rng = random.Random(3)
# the tiny V4 has ratios 4 (CSA) and 16 (HCA), window 8: with blocks of 8, boundaries every 16 tokens
MID = [_rng.randrange(2, 200) for _ in range(40)]     # a shared prefix ending mid-window: hits stop at 32
EDGE = [_rng.randrange(2, 200) for _ in range(48)]    # ending at a boundary: hits reach 48


@pytest.fixture(scope="module", params=["flash", "pro"])
def v4(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    make_v4_model(d, **({} if request.param == "flash" else dict(layer_types=PRO, seed=1)))
    return d


def _tail(n: int) -> list[int]:
    return [_rng.randrange(2, 200) for _ in range(n)]


PROMPTS = [MID + _tail(5), MID + _tail(17), MID[:33] + _tail(3), EDGE + _tail(1), EDGE + _tail(30), EDGE + _tail(9)]
WANT = [0, 32, 32, 0, 48, 48]   # cached tokens at admission (MID[:33] shares 33 tokens: boundary 32)


def _one_by_one(llm: LLM, prompts, params) -> list:
    return [llm.generate([p], params)[0] for p in prompts]


def _pools_whole(core) -> bool:
    b = core.blocks
    return (all(a.num_free == a.num_blocks and not any(a.refs) for a in b.allocators.values())
            and b.free_slots == b.num_slots and core.kv.streams == {})


@pytest.mark.parametrize("dbo,kv", [(False, "auto"), (True, "auto"), (False, "fp8")])
def test_hits_give_the_outputs_of_no_cache(v4, dbo, kv):
    """(fp8: the hits restore the packed rows; both runs read the same quantised window and entries.)"""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
    kw = dict(V4, block_size=8, max_num_batched_tokens=19, kv_cache_dtype=kv)
    if dbo:
        kw["dbo"] = {"enabled": True, "prefill_token_threshold": 2}
    off = _one_by_one(LLM(v4, enable_prefix_caching=False, **kw), PROMPTS, params)
    llm = LLM(v4, enable_prefix_caching=True, **kw)
    on = _one_by_one(llm, PROMPTS, params)
    # a prompt continuing the first one's output: its prefix's last blocks and boundary state were written in decode
    cont = PROMPTS[0] + on[0].outputs[0].token_ids + [9]
    on.append(llm.generate([cont], params)[0])
    off.append(LLM(v4, enable_prefix_caching=False, **kw).generate([cont], params)[0])
    assert [o.metrics["cached_tokens"] for o in on] == WANT + [len(cont) - 1 - (len(cont) - 1) % 16]
    for a, b in zip(off, on, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-4
    core = llm.engine.core
    assert core.blocks.hit_tokens == sum(WANT) + on[-1].metrics["cached_tokens"]
    assert core.blocks.num_cached > 0 and _pools_whole(core)
    if dbo:
        assert core.stats()["dbo_split_steps"] > 0


def test_concurrent_hits_share_blocks(v4):
    """Requests admitted together after the prefix is cached share its blocks (reference counts above one while
    they run); the pools are whole after."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(v4, enable_prefix_caching=True, block_size=8, **V4)
    llm.generate([EDGE + [3]], params)
    core, seen = llm.engine.core, []
    eng = llm.engine
    for i, p in enumerate(PROMPTS[3:]):
        eng.add_request(f"s{i}", p, params)
    while eng.has_unfinished_requests():
        eng.step()
        seen.append(max(max(a.refs) for a in core.blocks.allocators.values()))
    assert max(seen) == 3, "the three requests hold the cached prefix's blocks at once"
    assert _pools_whole(core)


def test_prompt_logprobs_skip_the_cache(v4):
    llm = LLM(v4, enable_prefix_caching=True, block_size=8, **V4)
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    first, again = llm.generate([PROMPTS[3]], p)[0], llm.generate([PROMPTS[3]], p)[0]
    assert again.metrics["cached_tokens"] == 0 and again.prompt_logprobs == first.prompt_logprobs


def test_block_size_that_cuts_compressed_blocks_is_refused(v4):
    with pytest.raises(ValueError, match=r"DeepSeek-V4 prefix caching needs block_size \(6\) to be a multiple or a "
                                         r"divisor of every compress ratio \(csa ratio 4, hca ratio 16\)"):
        LLM(v4, enable_prefix_caching=True, block_size=6, **V4)
    llm = LLM(v4, enable_prefix_caching=False, block_size=6, **V4)   # without prefix caching it serves
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def _workload(n: int, seed: int) -> list[dict]:
    """Random prompts (a third continuing one of three shared prefixes), lengths and arrival steps."""
    rng = random.Random(seed)
    shared = [[rng.randrange(2, 200) for _ in range(k)] for k in (21, 48, 70)]
    out = []
    for i in range(n):
        head = rng.choice(shared) if i % 3 == 0 else []
        prompt = head + [rng.randrange(2, 200) for _ in range(rng.randint(1, 60))]
        out.append(dict(id=f"r{i}", prompt=prompt, max_tokens=rng.randint(1, 16), arrival=rng.randint(0, 90)))
    return out


def _replay(eng, reqs: list[dict]) -> tuple[dict, dict, bool]:
    """Each request added at its arrival step, greedy, until all finish -> (request id -> tokens, request id ->
    its SamplingParams, whether some pool was ever at zero free blocks)."""
    by_step: dict[int, list[dict]] = {}
    for r in reqs:
        by_step.setdefault(r["arrival"], []).append(r)
    got, step, tight = {}, 0, False
    params = {r["id"]: SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs}
    while step <= max(by_step) or eng.has_unfinished_requests():
        for r in by_step.get(step, []):
            eng.add_request(r["id"], r["prompt"], params[r["id"]])
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        tight |= any(a.num_free == 0 for a in eng.core.blocks.allocators.values())
        step += 1
        assert step < 5000, "the engine made no progress"
    assert set(got) == {r["id"] for r in reqs}
    return got, params, tight


@pytest.mark.slow
@torch.no_grad()
def test_120_requests_under_kv_pressure_equal_alone_and_leak_nothing(v4):
    """The V3 replay for V4, prefix caching on: pools too small for the requests at once (preemption, cached blocks
    evicted and handed out again), every output equal to the request run alone, every pool whole after."""
    reqs = _workload(120, seed=7)
    eng = Engine(v4, block_size=8, kv_cache_blocks=40, max_num_seqs=8, max_num_batched_tokens=48,
                 enable_prefix_caching=True, **V4)
    core = eng.core
    got, params, tight = _replay(eng, reqs)
    stats = core.stats()
    assert stats["preemptions"] > 0 and tight, "the pools were meant to be small enough to preempt"
    assert core.blocks.hit_tokens > 0
    assert _pools_whole(core), f"blocks left held: {core.blocks.usage()}"
    solo = LLM(v4, block_size=8, max_num_seqs=1, enable_prefix_caching=False, **V4)
    bad = [r["id"] for r in reqs if solo.generate([r["prompt"]], params[r["id"]])[0].outputs[0].token_ids
           != got[r["id"]]]
    assert not bad, f"{len(bad)} requests differ from running alone, e.g. {bad[:5]}"


def test_the_rank_reports_the_hashes_its_pools_name(v4):
    """KV-aware routing (the default routing with prefix caching): the V4 block manager marks every hash its pools
    come to name or stop naming in the rank's log (drained to the front after each step), and holds() answers by
    the names: the first prompt's hashes are held, and no longer once other prompts' blocks push them out."""
    from wideep.kvstore.hashing import prefix_chain
    llm = LLM(v4, enable_prefix_caching=True, block_size=8, kv_cache_blocks=24, **V4)
    b = llm.engine.core.blocks
    assert b.log.enabled
    hashes = prefix_chain(EDGE + [3], 8)
    llm.generate([EDGE + [3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert all(b.holds(h) for h in hashes)
    rng = random.Random(9)
    for _ in range(6):
        llm.generate([[rng.randrange(2, 200) for _ in range(90)]], SamplingParams(max_tokens=1))
    assert not any(b.holds(h) for h in hashes)
    b.log.mark(hashes[0])
    assert b.take_events() is None   # not held, and the front was told so already
