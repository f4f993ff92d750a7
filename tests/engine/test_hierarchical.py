"""The two-level dispatcher end to end: on 4 gloo ranks seen as 2 nodes x 2, as 4 nodes x 1 and as
1 node, `hierarchical` (what `auto` picks with more than one node) gives the flat torch dispatcher's
greedy tokens and prompt logprobs (<= 1e-5, fp32), in normal and low-latency mode, with an idle rank, with DBO on and with EPLB
replicas rebalanced mid-run; the engine's stats carry the per-tier bytes and the routing histogram,
which never exceeds topk_group nodes (tiny V3: 4 groups, topk_group 2; at 4 nodes x 1 each node
holds one group)."""
from __future__ import annotations

import pytest
import torch

from tests.parallel.spawn import spawn

PROMPTS = {
    # 3 requests on 4 ranks: one rank idle, still in every all-to-all
    "idle": ([[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [120, 33, 71, 2, 88, 14, 160]], 6),
    "uneven": ([list(range(10, 90)), [7, 9], [100 + (i * 7) % 90 for i in range(30)], [1, 50, 2]], 5),
}


def _run(llm) -> dict:
    from wideep.engine import SamplingParams
    out = {}
    for name, (prompts, n) in PROMPTS.items():
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, prompt_logprobs=0, ignore_eos=True))
        out[name] = [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
                     for o in res]
    return out


def _rank(model_dir: str) -> dict:
    from wideep.engine import LLM
    from tests.parallel.test_dispatch_hierarchical import as_nodes
    kw = dict(progress=False, block_size=8, max_num_batched_tokens=64, enable_prefix_caching=False)
    # prefill steps in normal mode, decode steps (<= 4 tokens per rank) in the padded low-latency mode
    par = {"torch_low_latency_max_tokens": 8}
    flat = LLM(model_dir, dispatch_backend="torch", parallel=dict(par, ranks_per_node=2), **kw)
    base = flat.ctx
    assert (base.ranks_per_node, base.num_nodes) == (2, 2)
    runs = {"flat": _run(flat)}
    kinds, stats = {}, {}
    variants = {
        "2x2": (2, {}),
        "2x2-normal": (2, {"parallel": {"torch_low_latency_max_tokens": 0}}),
        "2x2-dbo": (2, {"dbo": {"enabled": True}}),
        "2x2-eplb": (2, {"parallel": dict(par, num_redundant_experts=4),
                         "eplb": {"enabled": True, "num_redundant_experts": 4, "window_size": 4, "step_interval": 3}}),
        "4x1": (1, {}),
        "4x1-dbo": (1, {"dbo": {"enabled": True}}),   # stage 2 is a local copy, on the DBO threads
        "1x4": (4, {"dispatch_backend": "hierarchical"}),
    }
    for name, (L, extra) in variants.items():
        llm = LLM(model_dir, ctx=as_nodes(base, L), **{**kw, "parallel": par, **extra})
        runs[name] = _run(llm)
        core = llm.engine.core
        kinds[name] = sorted({type(d).__name__ for d in core.dispatchers()})
        stats[name] = dict(core.stats(), rebalances=core.eplb.metrics["rebalances"] if core.eplb else 0,
                           calls=sum(d.stats.dispatch_calls for d in core.dispatchers()),
                           low_latency_calls=sum(d.stats.low_latency_calls for d in core.dispatchers()))
    flat.shutdown()
    return {"runs": runs, "kinds": kinds, "stats": stats}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("hier")), arch="v3", seed=3, initializer_range=0.2)


@pytest.mark.multirank
@pytest.mark.slow
def test_two_level_engine_equals_flat(model_dir):
    ranks = spawn(_rank, 4, args=(model_dir,), timeout_s=600)
    for r in ranks:
        assert r["kinds"]["2x2"] == r["kinds"]["4x1"] == r["kinds"]["1x4"] == ["HierarchicalDispatcher"]
        flat = r["runs"]["flat"]
        for name, got in r["runs"].items():
            for prompts in PROMPTS:
                for (tok_f, lp_f), (tok, lp) in zip(flat[prompts], got[prompts], strict=True):
                    assert tok == tok_f, (name, prompts)
                    assert (torch.tensor(lp) - torch.tensor(lp_f)).abs().max() <= 1e-5, (name, prompts)
        st = r["stats"]
        assert st["2x2-dbo"]["dbo_split_steps"] > 0 and st["4x1-dbo"]["dbo_split_steps"] > 0 and st["2x2-eplb"]["rebalances"] >= 1
        for name, s in st.items():      # both modes ran (only normal mode where it is off)
            assert s["calls"] > s["low_latency_calls"] > 0 or (name == "2x2-normal" and s["low_latency_calls"] == 0)
        for name in ("2x2", "4x1"):
            s = st[name]
            assert s["dispatch_bytes_inter"] > 0 and s["dispatch_bytes_remote"] == s["dispatch_bytes_intra"] + \
                s["dispatch_bytes_inter"]
        assert st["4x1"]["dispatch_bytes_intra"] == 0          # one rank per node: nothing inside a node
        assert st["1x4"]["dispatch_bytes_inter"] == 0          # one node: nothing between nodes
        # routing: at 4 nodes x 1 every node holds one of the 4 expert groups; tokens keep 2 groups
        hist = st["4x1"]["moe_nodes_per_token"]
        assert len(hist) == 5 and sum(hist) > 0 and hist[3] == hist[4] == 0 and hist[2] > 0, hist
        assert len(st["4x1"]["moe_nodes_per_token_step"]) == 5
