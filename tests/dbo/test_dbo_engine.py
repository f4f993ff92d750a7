"""DBO on and off give the same outputs (fp32, <= 1e-5) at ep 2 and 4, prefill- and decode-heavy,
odd token counts, one rank idle; the overlapped path really ran (its dispatchers moved tokens);
with the allgather backend DBO runs allgather microbatch dispatchers (never a silent switch)."""
from __future__ import annotations

import pytest
import torch

from tests.parallel.spawn import spawn

WORKLOADS = {
    # long odd-length prompts, few new tokens: prompts get cut across the two microbatches
    "prefill": ([[3 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([37, 5, 61, 1, 23])], 3),
    # short prompts, many new tokens: decode steps split by request
    "decode": ([[5 + i, 9, 11 + i] for i in range(7)], 12),
    # 3 requests on 4 ranks: one rank idle, still in every all-to-all of both microbatches
    "idle": ([[7, 8, 9, 10, 11], [12, 13], [14, 15, 16]], 6),
}


def _run(llm, prompts, max_tokens):
    from wideep.engine import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=0,
                                                ignore_eos=True))
    return [(o.outputs[0].token_ids,
             [lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]) for o in outs]


def _rank(model_dir: str, dbo_mode) -> dict:
    from wideep.engine import LLM
    kw = dict(progress=False, block_size=8, max_num_batched_tokens=64)
    off = LLM(model_dir, **kw)
    on = LLM(model_dir, ctx=off.ctx, dbo={"enabled": dbo_mode}, **kw)
    res = {name: (_run(off, p, n), _run(on, p, n)) for name, (p, n) in WORKLOADS.items()}
    moved = sum(d.stats.dispatch_calls for d in on.engine.core.runner.overlap.dispatchers)
    off.shutdown()
    return {"res": res, "overlap_dispatches": moved}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("dbo")), arch="v3", seed=6, initializer_range=0.2)


@pytest.mark.multirank
@pytest.mark.parametrize("ep", [2, 4])
def test_dbo_on_equals_off(model_dir, ep):
    for rank in spawn(_rank, ep, args=(model_dir, True), timeout_s=300):
        assert rank["overlap_dispatches"] > 0
        for name, (off, on) in rank["res"].items():
            for (tok_off, lp_off), (tok_on, lp_on) in zip(off, on):
                assert tok_on == tok_off, name
                if lp_off:
                    assert (torch.tensor(lp_on) - torch.tensor(lp_off)).abs().max() <= 1e-5, name


@pytest.mark.multirank
def test_dbo_auto_equals_off(model_dir):
    for rank in spawn(_rank, 2, args=(model_dir, "auto"), timeout_s=300):
        for name, (off, on) in rank["res"].items():
            assert [t for t, _ in on] == [t for t, _ in off], name


def _rank_eplb(model_dir: str) -> dict:
    from wideep.engine import LLM
    kw = dict(progress=False, block_size=8, max_num_batched_tokens=64)
    off = LLM(model_dir, **kw)
    on = LLM(model_dir, ctx=off.ctx, dbo={"enabled": True}, parallel={"num_redundant_experts": 2},
             eplb={"enabled": True, "num_redundant_experts": 2, "window_size": 4, "step_interval": 3}, **kw)
    res = {name: (_run(off, p, n), _run(on, p, n)) for name, (p, n) in WORKLOADS.items()}
    rebalances = on.engine.core.eplb.metrics["rebalances"]
    stats = on.engine.core.stats()
    off.shutdown()
    return {"res": res, "rebalances": rebalances, "stats": stats}


@pytest.mark.multirank
def test_dbo_with_eplb_rebalancing_during_the_run(model_dir):
    for rank in spawn(_rank_eplb, 2, args=(model_dir,), timeout_s=300):
        assert rank["rebalances"] >= 2
        st = rank["stats"]   # what the engine reports per rank (metrics, Prometheus)
        assert st["eplb_rebalances"] == rank["rebalances"] and 0 < st["eplb_balancedness"] <= 1
        assert st["dbo_split_steps"] > 0 and st["dispatch_bytes_remote"] > 0
        for name, (off, on) in rank["res"].items():
            for (tok_off, lp_off), (tok_on, lp_on) in zip(off, on):
                assert tok_on == tok_off, name
                if lp_off:
                    assert (torch.tensor(lp_on) - torch.tensor(lp_off)).abs().max() <= 1e-5, name


def _rank_allgather(model_dir: str) -> dict:
    from wideep.engine import LLM
    kw = dict(progress=False, block_size=8, max_num_batched_tokens=64, parallel={"dispatch_backend": "allgather"})
    off = LLM(model_dir, **kw)
    on = LLM(model_dir, ctx=off.ctx, dbo={"enabled": True}, **kw)
    res = {name: (_run(off, p, n), _run(on, p, n)) for name, (p, n) in WORKLOADS.items() if name != "idle"}
    dispatchers = on.engine.core.runner.overlap.dispatchers
    kinds = sorted({type(d).__name__ for d in [on.model.dispatcher, *dispatchers]})
    moved = sum(d.stats.dispatch_calls for d in dispatchers)
    off.shutdown()
    return {"res": res, "kinds": kinds, "overlap_dispatches": moved}


@pytest.mark.multirank
def test_dbo_with_allgather_runs_allgather_and_equals_off(model_dir):
    for rank in spawn(_rank_allgather, 2, args=(model_dir,), timeout_s=300):
        assert rank["kinds"] == ["AllGatherDispatcher"] and rank["overlap_dispatches"] > 0
        for name, (off, on) in rank["res"].items():
            for (tok_off, lp_off), (tok_on, lp_on) in zip(off, on):
                assert tok_on == tok_off, name
                if lp_off:
                    assert (torch.tensor(lp_on) - torch.tensor(lp_off)).abs().max() <= 1e-5, name
