"""Width on one host: 16 ranks with DeepSeek-V3's routing structure (64 experts in 8 groups, top-8 of
4 groups, 16 redundant slots: 5 per rank) give exactly one process's outputs, the per-step control on
every worker is one fixed-size all-reduce whatever the batch, and a rank killed mid-generation is
named by every survivor within the timeout."""
from __future__ import annotations

import pytest

from tests.faults import sigkill_at_step
from tests.parallel.spawn import run, spawn

RANKS, TIMEOUT_S = 16, 60.0
PROMPTS = [[3 + (7 * i + j) % 200 for j in range(4 + (5 * i) % 23)] for i in range(20)]


@pytest.fixture(scope="module")
def v3_routing(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("width")), arch="v3", seed=2, hidden_size=32,
                                num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=64, n_group=8,
                                topk_group=4, num_experts_per_tok=8, moe_intermediate_size=16, initializer_range=0.3)


def _generate(model_dir: str) -> dict:
    import torch.distributed as dist

    from wideep import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, block_size=8, kv_cache_blocks=64,
              parallel={"num_redundant_experts": 16, "timeout_s": TIMEOUT_S})
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(PROMPTS[:2], sp)        # warm-up; then count one generate's control traffic
    calls: dict = {}
    saved = {n: getattr(dist, n) for n in ("all_reduce", "broadcast", "all_gather", "gather", "barrier",
                                          "broadcast_object_list", "all_gather_object", "gather_object")}

    def counting(name, fn):
        def wrapped(*a, **k):
            c = calls.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += a[0].numel() * a[0].element_size() if name == "all_reduce" else 0
            return fn(*a, **k)
        return wrapped
    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    sync = llm.engine.core.sync
    syncs0, steps0 = sync.calls, llm.engine.loop.steps
    outs = llm.generate(PROMPTS, sp)
    for name, fn in saved.items():
        setattr(dist, name, fn)
    res = {"tokens": [o.outputs[0].token_ids for o in outs],
           "logprobs": [[lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs],
           "steps": llm.engine.loop.steps - steps0, "syncs": sync.calls - syncs0, "calls": calls}
    llm.shutdown()
    return res


@pytest.mark.multirank
@pytest.mark.slow
def test_16_ranks_equal_one_process(v3_routing):
    alone = spawn(_generate, 1, args=(v3_routing,), timeout_s=200)[0]
    ranks = spawn(_generate, RANKS, args=(v3_routing,), timeout_s=600)
    for r in ranks:
        assert r["tokens"] == alone["tokens"]
        for a, b in zip(r["logprobs"], alone["logprobs"]):
            assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= 1e-4
    for w in ranks[1:]:
        # a worker's only collective in its step loop is the step sync: one all-reduce of 6 int64s per
        # iteration (the steps, plus the idle and command iterations that end a wave); the two object
        # broadcasts are LLM.generate's own (validation verdict, results), once per call
        n, nbytes = w["calls"]["all_reduce"]
        assert n == w["syncs"] and nbytes == 48 * n and w["steps"] <= n <= w["steps"] + 10, w
        assert w["calls"].get("broadcast_object_list", [0])[0] == 2
        assert set(w["calls"]) <= {"all_reduce", "broadcast_object_list", "broadcast"}, w["calls"]


def _generate_until_killed(model_dir: str, victim: int) -> None:
    from wideep import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, parallel={"num_redundant_experts": 16, "timeout_s": TIMEOUT_S})
    if llm.ctx.rank == victim:
        sigkill_at_step(3)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    raise AssertionError("generation finished although a rank was killed")


@pytest.mark.multirank
@pytest.mark.slow
def test_a_rank_killed_at_16_ranks_is_named_by_every_survivor(v3_routing):
    victim = 11
    outs = run(_generate_until_killed, RANKS, args=(v3_routing, victim), timeout_s=600)
    died = outs[victim]
    assert died.returncode == -9, died.stderr[-2000:]
    for o in outs:
        if o.rank == victim:
            continue
        assert o.returncode not in (0, None), f"rank {o.rank} exited {o.returncode}"
        assert f"rank {victim} lost" in o.stderr, f"rank {o.rank}:\n{o.stderr[-2000:]}"
        assert o.elapsed_s - died.elapsed_s < TIMEOUT_S, (o.rank, o.elapsed_s, died.elapsed_s)
