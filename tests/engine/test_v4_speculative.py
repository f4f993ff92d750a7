"""Speculative decoding with DeepSeek-V4 (n-gram drafts): a verification is one chunk of a sequence's last token and
its drafts, and the rejected drafts must leave no trace in its streams.

- The compressor's Rewind rebuilds, for every position of a chunk, the state feeding only the tokens before it
  gives (CSA with its overlap rows, HCA), to float32 rounding (the projections of 7 rows and of 1 round apart).
- Greedy outputs (tokens, logprobs within 1e-4) equal without speculation on launch/tiny/cycle.py's V4 model (drafts
  mostly right, some rejected, so windows close on rejected drafts), both layer orders, k = 1 and 3, with DBO
  cutting verification chunks between microbatches, under KV pressure with preemption and prefix caching, and
  with stop tokens inside the accepted drafts; every pool is whole after.
- Sampling with drafts is seeded (two engines agree); DP/EP ranks: tests/engine/test_v4_wide_ep.py.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from wideep.attention_mla.rope import RotaryEmbedding
from wideep.attention_v4.compressor import Compressor, CompressorState
from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.launch.tiny.cycle import cycle_prompts, make_v4_cycle_checkpoint
from wideep.launch.tiny.v4 import PRO
from tests.engine.test_engine import drive, workload
from tests.engine.test_speculative import ngram, same

V4 = dict(dtype="float32", progress=False, enable_prefix_caching=False, block_size=16)


# -- the compressor's rewind -------------------------------------------------------------------------------------
def _rope():
    from wideep.attention_mla.config import RopeConfig
    return RotaryEmbedding(RopeConfig(dim=8))


def _fed(comp: Compressor, x: torch.Tensor, p0: int, rope) -> CompressorState:
    """The state after feeding x's first p0 rows in one chunk."""
    st = CompressorState.empty(comp.width, x.device, x.dtype)
    if p0:
        comp(x[:p0], st, rope)
    return st


@pytest.mark.parametrize("ratio,overlap", [(4, True), (16, False), (4, False)])
@pytest.mark.parametrize("p0", [0, 3, 4, 13, 30])
def test_rewind_gives_the_state_of_the_kept_tokens(ratio, overlap, p0):
    torch.manual_seed(ratio + p0)
    comp = Compressor(24, 16, ratio, overlap, 1e-6)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn_like(p))
    rope = _rope()
    T = 7 if ratio == 4 else 20   # spans windows that close inside the chunk
    x = torch.randn(p0 + T, 24)
    with torch.no_grad():
        st = _fed(comp, x, p0, rope)
        st.keep = True
        comp(x[p0:], st, rope)
        rw = st.rewind
        assert rw.start == p0 // ratio * ratio and rw.end == p0 + T
        for p in range(p0, p0 + T + 1):
            got, want = rw.state_at(p), _fed(comp, x, p, rope)
            assert got.entries == want.entries == p // ratio
            for a, b in ((got.buf_kv, want.buf_kv), (got.buf_gate, want.buf_gate)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"position {p}")
            if want.prev_kv is None:
                assert got.prev_kv is None
            else:
                for a, b in ((got.prev_kv, want.prev_kv), (got.prev_gate, want.prev_gate)):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"position {p}")
        with pytest.raises(ValueError, match="the chunk's rows cover"):
            rw.state_at(p0 + T + 1)


# -- through the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["flash", "pro"])
def cycle(request, tmp_path_factory):
    """mix 0.25: the model mostly continues its cycle (acceptance ~0.85 at k = 3), and drafts still fail often
    enough to reject inside CSA (4:1) and HCA (16:1) windows."""
    kw = {} if request.param == "flash" else dict(layer_types=PRO)
    return make_v4_cycle_checkpoint(str(tmp_path_factory.mktemp("v4cyc")), period=12, mix=0.25, gain=20.0, seed=1,
                                    **kw)


def _generate(d, prompts, spec=None, max_tokens=40, sp=None, **kw):
    llm = LLM(d, speculative_config=spec, **dict(V4, **kw))
    sp = sp or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
    m, core = llm.engine.metrics(), llm.engine.core
    assert all(a.num_free == a.num_blocks for a in core.blocks.allocators.values()), core.blocks.usage()
    assert core.blocks.free_slots == core.blocks.num_slots and core.kv.streams == {}
    llm.shutdown()
    return outs, m


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equal_with_drafts(cycle, k):
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 8, 30, seed=0)
    ref, _ = _generate(d, prompts)
    got, m = _generate(d, prompts, ngram(k))
    same(got, ref)
    rate = m["spec_decode_acceptance_rate"]
    assert m["spec_decode_num_draft_tokens"] > 20 and 0.3 < rate < 1.0, (m["spec_decode_num_draft_tokens"], rate)
    assert len(m["spec_decode_num_accepted_tokens_per_pos"]) == k


def test_dbo_cuts_verifications_between_microbatches(cycle):
    """Blocks of 4 tokens and DBO from 2 tokens: steps of a few verifications split mid-chunk, the second part's
    compressor states continue the first's; the rewind takes the part whose rows reach the first rejection."""
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 3, 30, seed=4)
    ref, _ = _generate(d, prompts, block_size=4)
    llm = LLM(d, speculative_config=ngram(3), **dict(V4, block_size=4,
                                                     dbo={"enabled": True, "prefill_token_threshold": 2}))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    got = [o.outputs[0] for o in llm.generate(prompts, sp)]
    same(got, ref)
    m = llm.engine.metrics()
    assert llm.engine.core.split_steps > 0 and 0 < m["spec_decode_acceptance_rate"] < 1
    llm.shutdown()


def _shared_start_workload(nxt, n: int, seeds: tuple[int, int], last_arrival: int) -> list[dict]:
    """n random arrivals whose prompts follow the cycle, every other one starting with the same 32 tokens (prefix
    hits)."""
    reqs = workload(n, seed=seeds[0], max_prompt=50, max_new=30, last_arrival=last_arrival)
    ps = cycle_prompts(nxt, n, 30, seed=seeds[1])
    shared = ps[0][:32]
    for i, (r, p) in enumerate(zip(reqs, ps)):
        r["prompt"] = (shared if i % 2 else []) + p[:max(2, len(r["prompt"]) % 30)]
    return reqs


def _each_equals_its_run_alone(d, reqs: list[dict], got: dict) -> None:
    """Every request's greedy tokens equal the request run alone, without speculation."""
    llm = LLM(d, **V4)
    for r in reqs:
        want = llm.generate([r["prompt"]], SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                                          ignore_eos=True))
        assert got[r["id"]] == want[0].outputs[0].token_ids, r["id"]
    llm.shutdown()


def test_greedy_equal_under_preemption_with_prefix_caching(cycle):
    """Random arrivals, pools that force preemption, prefix caching on (shared starts hit, boundary state rows
    written by steps whose drafts were then rejected): every output equals the request run alone without
    speculation, and every pool is whole after."""
    d, nxt = cycle
    reqs = _shared_start_workload(nxt, 24, seeds=(3, 9), last_arrival=20)
    eng = Engine(d, **dict(V4, block_size=8, kv_cache_blocks=16, max_num_seqs=6, max_num_batched_tokens=48,
                           enable_prefix_caching=True, speculative_config=ngram(3)))
    got = drive(eng, reqs)
    core, m = eng.core, eng.metrics()
    assert core.scheduler.num_preemptions > 0 and m["spec_decode_num_accepted_tokens"] > 0
    assert core.blocks.hit_tokens > 0
    assert all(a.num_free == a.num_blocks for a in core.blocks.allocators.values()), core.blocks.usage()
    eng.shutdown()
    _each_equals_its_run_alone(d, reqs, got)


def test_stop_tokens_inside_accepted_drafts(cycle):
    d, nxt = cycle
    prompt = cycle_prompts(nxt, 1, 30, seed=2)[0]
    base = _generate(d, [prompt], max_tokens=30)[0][0]
    for i in (5, 14):
        stop = base.token_ids[i]
        first = base.token_ids.index(stop)
        sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
        out = _generate(d, [prompt], ngram(3), sp=sp)[0][0]
        assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"


def test_sampling_with_drafts_is_seeded(cycle):
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 3, 30, seed=5)
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=7, ignore_eos=True)
    runs = [_generate(d, prompts, ngram(2), sp=sp) for _ in range(2)]
    assert [o.token_ids for o in runs[0][0]] == [o.token_ids for o in runs[1][0]]
    assert all(len(o.token_ids) == 30 for o in runs[0][0]) and runs[0][1]["spec_decode_num_accepted_tokens"] > 0


# -- DP/EP ranks ---------------------------------------------------------------------------------------------
def _rank_spec(model_dir: str, ep: int, prompts: list[list[int]]) -> dict:
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, dp_size=ep, ep_size=ep, parallel={"timeout_s": 60.0}, speculative_config=ngram(3),
              dbo={"enabled": True, "prefill_token_threshold": 2}, **dict(V4, block_size=4))
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
    spec = llm.engine.core.scheduler.speculator   # this rank's own drafts
    out = {"rank": llm.ctx.rank, "tokens": [o.token_ids for o in outs],
           "logprobs": [[list(d.values())[0] for d in o.logprobs] for o in outs],
           "split_steps": llm.engine.core.split_steps, "accepted": spec.num_accepted_tokens,
           "drafts": spec.num_draft_tokens}
    llm.shutdown()
    return out


@pytest.mark.multirank
def test_drafts_on_2_ep_ranks_with_dbo(cycle):
    """2 DP/EP ranks, DBO on: each rank verifies its own sequences' drafts (k fixed per step, a rank without drafts
    runs its plain rows) in the same all-to-alls; outputs equal one process without speculation."""
    from tests.parallel.spawn import spawn
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 5, 30, seed=11)
    ref, _ = _generate(d, prompts, max_tokens=30, block_size=4)
    ranks = spawn(_rank_spec, 2, args=(d, 2, prompts), timeout_s=300)
    for r in ranks:
        assert r["tokens"] == [o.token_ids for o in ref]
        for got, want in zip(r["logprobs"], ref):
            assert got == pytest.approx([list(x.values())[0] for x in want.logprobs], abs=1e-4)
    assert all(r["accepted"] > 0 for r in ranks) and any(r["split_steps"] > 0 for r in ranks)


# -- MTP: block 0 drafts -----------------------------------------------------------------------------------------
def mtp(k=3, **kw):
    return dict(method="mtp", num_speculative_tokens=k, **kw)


@pytest.fixture(scope="module", params=["flash", "pro"])
def mtp_cycle(request, tmp_path_factory):
    """launch/tiny/cycle.py's V4 model with an MTP block built to predict the token after next (acceptance ~0.86
    at k = 3 on the flash order)."""
    kw = {} if request.param == "flash" else dict(layer_types=PRO)
    return make_v4_cycle_checkpoint(str(tmp_path_factory.mktemp("v4mtp")), period=12, mix=0.25, gain=20.0, seed=1,
                                    mtp=True, **kw)


@torch.no_grad()
def test_mtp_drafts_are_the_blocks_argmax_over_a_dense_reference(mtp_cycle):
    """After a prompt's prefill the sequence's k drafts are the MTP block's argmax as a dense reference computes
    them: the target over the prompt (its residual streams), the block over positions 0..P-1 with each next token,
    then its own output and draft fed back one position at a time."""
    from wideep.attention_v4.streams import SequenceStreams, V4Meta
    d, nxt = mtp_cycle
    prompt = cycle_prompts(nxt, 1, 30, seed=3)[0]
    eng = Engine(d, **dict(V4, speculative_config=mtp(3)))
    eng.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    first = eng.step()[0].outputs[0].token_ids
    assert len(first) == 1
    s = eng.core.scheduler.running[0]
    model, v4 = eng.core.model, eng.core.model.cfg.v4
    st = SequenceStreams.empty(v4.attention, v4.layer_kinds + v4.mtp_layer_kinds[:1], model.device, model.dtype)
    P = len(prompt)
    rows = model(torch.tensor(prompt), V4Meta.build([P], [st]))
    assert model.logits(rows[-1:]).argmax().item() == first[0]
    out = model.mtp_forward(0, torch.tensor(prompt[1:] + first), model.streams_of(rows), V4Meta.build([P], [st],
                                                                                                       offsets=[-P]))
    out, want = out[-1:], []
    for j in range(3):
        if j:
            out = model.mtp_forward(0, torch.tensor(want[-1:]), out, V4Meta.build([1], [st], offsets=[j - 1]))
        want.append(model.mtp_logits(0, out).argmax().item())
    assert s.spec.mtp_drafts == want
    eng.shutdown()


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equal_and_accepted(mtp_cycle, k):
    d, nxt = mtp_cycle
    prompts = cycle_prompts(nxt, 6, 30, seed=0)
    ref, _ = _generate(d, prompts)
    got, m = _generate(d, prompts, mtp(k))
    same(got, ref)
    rate = m["spec_decode_acceptance_rate"]
    assert m["spec_decode_num_draft_tokens"] > 100 and 0.6 < rate < 1.0, (m["spec_decode_num_draft_tokens"], rate)
    assert m["spec_decode_mean_acceptance_length"] > 1.5


def test_mtp_with_dbo_preemption_and_prefix_caching(mtp_cycle):
    """DBO cutting steps, pools that force preemption, prefix caching (hits restore the MTP layer's window rows
    with the others'): every output equals the request run alone without speculation; every pool whole after."""
    d, nxt = mtp_cycle
    reqs = _shared_start_workload(nxt, 16, seeds=(8, 12), last_arrival=12)
    eng = Engine(d, **dict(V4, block_size=8, kv_cache_blocks=16, max_num_seqs=6, max_num_batched_tokens=48,
                           enable_prefix_caching=True, speculative_config=mtp(3),
                           dbo={"enabled": True, "prefill_token_threshold": 2}))
    got = drive(eng, reqs)
    core, m = eng.core, eng.metrics()
    assert core.scheduler.num_preemptions > 0 and core.blocks.hit_tokens > 0 and core.split_steps > 0
    assert m["spec_decode_acceptance_rate"] > 0.5
    assert all(a.num_free == a.num_blocks for a in core.blocks.allocators.values()), core.blocks.usage()
    eng.shutdown()
    _each_equals_its_run_alone(d, reqs, got)


def test_mtp_stop_tokens_and_sampling(mtp_cycle):
    d, nxt = mtp_cycle
    prompt = cycle_prompts(nxt, 1, 30, seed=2)[0]
    base = _generate(d, [prompt], max_tokens=30)[0][0]
    stop = base.token_ids[9]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    out = _generate(d, [prompt], mtp(3), sp=sp)[0][0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=7, ignore_eos=True)
    runs = [_generate(d, [prompt], mtp(2), sp=sp) for _ in range(2)]
    assert runs[0][0][0].token_ids == runs[1][0][0].token_ids and len(runs[0][0][0].token_ids) == 30
    assert runs[0][1]["spec_decode_num_accepted_tokens"] > 0


def test_mtp_without_the_block_is_refused(cycle):
    d, _ = cycle   # no mtp.* tensors
    with pytest.raises(ValueError, match=r"speculative method 'mtp' needs the checkpoint's MTP block \(mtp\.0\.\*\)"):
        LLM(d, speculative_config=mtp(2), **V4)


def test_a_draft_dtype_for_the_v4_block_is_refused(mtp_cycle):
    d, _ = mtp_cycle
    with pytest.raises(ValueError, match="draft_dtype 'bfloat16': DeepSeek-V4's MTP block runs in the model's dtype"):
        LLM(d, speculative_config=mtp(2, draft_dtype="bf16"), **V4)


def _rank_mtp(model_dir: str, ep: int, prompts: list[list[int]], dbo: bool) -> dict:
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, dp_size=ep, ep_size=ep, parallel={"timeout_s": 60.0}, speculative_config=mtp(2),
              dbo={"enabled": dbo, "prefill_token_threshold": 2}, **dict(V4, block_size=4))
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
    spec, drafter = llm.engine.core.scheduler.speculator, llm.engine.core.runner.drafter
    out = {"tokens": [o.token_ids for o in outs], "accepted": spec.num_accepted_tokens,
           "drafted": spec.num_draft_tokens, "passes": drafter.passes,
           "dispatch_calls": llm.model.dispatcher.stats.as_dict()["dispatch_calls"]}
    llm.shutdown()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("ep,dbo", [(2, True), pytest.param(4, False, marks=pytest.mark.slow)])
def test_mtp_on_ep_ranks(mtp_cycle, ep, dbo):
    """The MTP block's MoE is collective: every rank runs the same passes (one idles for a while: prompts of
    different lengths, 2 ranks: 3 prompts, 4 ranks: 5) and enters the same all-to-alls; outputs equal one process
    without speculation."""
    from tests.parallel.spawn import spawn
    d, nxt = mtp_cycle
    prompts = cycle_prompts(nxt, ep + 1, 30, seed=13)
    prompts[2] = prompts[2][:6]
    ref, _ = _generate(d, prompts, max_tokens=30, block_size=4)
    ranks = spawn(_rank_mtp, ep, args=(d, ep, prompts, dbo), timeout_s=400)
    for r in ranks:
        assert r["tokens"] == [o.token_ids for o in ref]
        assert r["accepted"] > 0.5 * r["drafted"] > 0
    assert len({r["passes"] for r in ranks}) == 1 and len({r["dispatch_calls"] for r in ranks}) == 1


def test_mtp_deferred_rows_give_the_drafts_of_rows_run_at_once(mtp_cycle):
    """Sequences backing off (a high min_acceptance, short pauses) defer their MTP rows to a stash of the last W - 1
    rows and run them in the pass before they draft again: the same drafts (so the same acceptance, position by
    position) as a drafter that runs every row every step, with fewer rows (one prompt: fewer passes too), and the
    same output as no speculation."""
    d, nxt = mtp_cycle
    spec = mtp(3, min_acceptance=0.9, backoff_steps=12)   # pauses longer than the window: stashes trimmed
    for n in (6, 1):
        _deferred_vs_at_once(d, cycle_prompts(nxt, n, 30, seed=21), spec, passes_fewer=n == 1)


def _deferred_vs_at_once(d, prompts, spec, passes_fewer):
    ref, _ = _generate(d, prompts, max_tokens=60)
    runs = {}
    for defers in (True, False):
        llm = LLM(d, speculative_config=spec, **V4)
        drafter = llm.engine.core.runner.drafter
        drafter.defers = defers
        outs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60,
                                                                          ignore_eos=True, logprobs=0))]
        same(outs, ref)
        m = llm.engine.metrics()
        runs[defers] = (m["spec_decode_num_accepted_tokens_per_pos"], m["spec_decode_num_draft_tokens"],
                        m["spec_decode_backoffs"], drafter.rows, drafter.passes)
        llm.shutdown()
    (acc, drafted, backoffs, rows, passes), (acc0, drafted0, _, rows0, passes0) = runs[True], runs[False]
    assert backoffs > 0 and drafted > 0
    assert (acc, drafted) == (acc0, drafted0), runs
    assert rows < rows0 and (passes < passes0 or not passes_fewer), runs
