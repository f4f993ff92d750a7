"""Flat vs two-level MoE dispatch at 8, 16, 32 local gloo ranks as 2 and 4 simulated nodes.

DeepSeek-V3's routing structure: 256 routed experts in 8 groups, a token keeps its 4 best groups
and its 8 best experts in them (noaux_tc, sigmoid, one random gate shared by all ranks); the
start-up placement (expert e in slot e) puts each group on consecutive ranks, so groups never
straddle nodes. T tokens per rank, rows of H fp32; the "experts" are a cheap exact function of the
row and its slots (as the dispatch tests'), so the step is all communication. Per configuration:
  inter-node bytes vs the minimum: dispatch bytes sent to other nodes (DispatchStats, all ranks)
      / (unique (token, destination node != own node) pairs x row bytes): exactly 1.0 for the
      two-level path; the flat path sends a token once per destination *rank*;
  step time (dispatch + combine, slowest rank, median of interleaved barrier-aligned trials)
      under a two-tier simulated network, the inter-node link 4x slower than the intra-node one
      (latency and bandwidth), and the links' share of it (SimulatedNetwork.delay_s);
  outputs equal: the two-level result vs the flat one, fp32, max |diff| <= 1e-5 (all ranks);
  the nodes-per-token histogram (routing accounting); the padded low-latency mode's bytes at T_ll.
Ranks share this host's cores, so the measured step time includes ranks waiting for a core; the
links are slow enough (defaults below) to dominate it. Last line: JSON, worst case over the
configurations: {"inter_node_bytes_vs_min": {"two_level": .., "flat": ..}, "outputs_equal": ..,
"step_time_two_level_vs_flat": .. (worst; _best beside it), "step_ms": {"RANKSxNODES": {"flat": ..,
"two_level": ..}} (wall ms per step, median), "detail": {...}}; kept (with --record) in bench/results/dispatch.json.
    python bench/dispatch.py [--quick] [--sizes 8,16,32] [--nodes 2,4] [--slow 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402

E, GROUPS, TOPK_GROUP, TOPK = 256, 8, 4, 8
LINK = {"intra_us": 50.0, "intra_gbps": 1.0, "inter_us": 200.0, "inter_gbps": 0.25}


def _fake_experts(d, first: int, P: int):
    """Rows [R, H] -> weighted sum over the row's local slots of x * (1 + g/P) + g/P (g global id)."""
    valid = d.topk_ids >= 0
    g = (d.topk_ids + first).clamp(min=0).float() / P
    w = d.topk_weights * valid
    return d.x * (w * (1 + g)).sum(1, keepdim=True) + (w * g).sum(1, keepdim=True)


def worker(nodes: int, T: int, H: int, trials: int, T_ll: int, slow: int = 1) -> None:
    import torch
    import torch.distributed as dist

    from wideep.moe.config import MoEConfig
    from wideep.moe.gate import Gate
    from wideep.parallel import ParallelConfig, StepPlan, bootstrap, make_dispatcher, shutdown
    from wideep.parallel.comm_stream import SimulatedLink, SimulatedNetwork
    world = int(os.environ["WORLD_SIZE"])
    ctx = bootstrap(ParallelConfig(dp_size=world, ep_size=world, ranks_per_node=world // nodes, timeout_s=600))
    rank, L = ctx.rank, ctx.ranks_per_node
    cfg = MoEConfig(hidden_size=H, moe_intermediate_size=8, n_routed_experts=E, n_shared_experts=0, top_k=TOPK,
                    n_group=GROUPS, topk_group=TOPK_GROUP, topk_method="noaux_tc", scoring_func="sigmoid",
                    norm_topk_prob=True, routed_scaling_factor=2.5)
    gate = Gate(cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        gate.weight.copy_(torch.randn(E, H, generator=g) / H ** 0.5)
        gate.e_score_correction_bias.copy_(0.05 * torch.randn(E, generator=g))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1000 + rank))
    with torch.no_grad():
        ids, w = gate(x)

    def network():   # slow: both bandwidths divided by it
        return SimulatedNetwork(SimulatedLink(LINK["intra_us"], LINK["intra_gbps"] / slow),
                                SimulatedLink(LINK["inter_us"], LINK["inter_gbps"] / slow))
    disp = {name: make_dispatcher(ctx, E, H, backend, link=network(), torch_low_latency_max_tokens=T_ll)
            for name, backend in (("flat", "torch"), ("two_level", "hierarchical"))}
    per = E // world
    row = H * 4
    node_of = (ids // per) // L                                                     # [T, k]
    pairs = sum(len(set(r.tolist()) - {ctx.node_rank}) for r in node_of)            # unique (token, other node)

    def step(d, xs, ii, ww, plan=StepPlan()):
        got = d.dispatch(xs, ii, ww, plan)
        return d.combine(_fake_experts(got, rank * per, E), got.handle)

    res = {}
    with torch.no_grad():
        for d in disp.values():                      # warm-up (first all-to-alls set up connections)
            step(d, x, ids, w)
        outs, times, delay = {}, {n: [] for n in disp}, {n: [] for n in disp}
        for d in disp.values():
            d.stats.reset()
            d.routing.reset()
        for t in range(trials):
            for name in (("flat", "two_level") if t % 2 == 0 else ("two_level", "flat")):
                d = disp[name]
                dist.barrier(group=ctx.cpu_group)
                d0 = d.link.delay_s
                t0 = time.perf_counter()
                outs[name] = step(d, x, ids, w)
                times[name].append(time.perf_counter() - t0)
                delay[name].append(d.link.delay_s - d0)
        st = {n: d.stats.as_dict() for n, d in disp.items()}
        hist = disp["two_level"].routing.tolist()
        diff = (outs["two_level"] - outs["flat"]).abs().max().item() if T else 0.0
        # padded low-latency mode at T_ll tokens per rank
        ll = {}
        plan = StepPlan.make(T_ll, low_latency_max_tokens=T_ll)
        for name, d in disp.items():
            d.stats.reset()
            out = step(d, x[:T_ll], ids[:T_ll], w[:T_ll], plan)
            ll[name] = (d.stats.dispatch_bytes_inter, out)
        ll_diff = (ll["two_level"][1] - ll["flat"][1]).abs().max().item()
    # every rank's numbers -> rank 0: sums of bytes, the slowest rank per trial
    vec = torch.tensor([pairs * row, st["flat"]["dispatch_bytes_inter"], st["two_level"]["dispatch_bytes_inter"],
                        st["flat"]["dispatch_bytes_intra"], st["two_level"]["dispatch_bytes_intra"],
                        st["flat"]["combine_bytes_inter"], st["two_level"]["combine_bytes_inter"],
                        ll["flat"][0], ll["two_level"][0]] + hist, dtype=torch.float64)
    dist.all_reduce(vec, group=ctx.cpu_group)
    worst = torch.tensor([max(diff, ll_diff)] + times["flat"] + times["two_level"] + delay["flat"] + delay["two_level"],
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    if rank == 0:
        v = vec.tolist()
        n = trials
        wl = worst.tolist()
        tf, tt, df, dt = wl[1:1 + n], wl[1 + n:1 + 2 * n], wl[1 + 2 * n:1 + 3 * n], wl[1 + 3 * n:]
        res = {"ranks": world, "nodes": nodes, "ranks_per_node": L, "tokens_per_rank": T, "row_bytes": row,
               "min_inter_node_bytes": int(v[0]),
               "inter_node_bytes_per_step": {"flat": int(v[1] / trials), "two_level": int(v[2] / trials)},
               "inter_node_bytes_vs_min": {"flat": round(v[1] / (trials * v[0]), 4),
                                           "two_level": round(v[2] / (trials * v[0]), 6)},
               "intra_node_bytes_per_step": {"flat": int(v[3] / trials), "two_level": int(v[4] / trials)},
               "combine_inter_node_bytes_vs_min": {"flat": round(v[5] / (trials * v[0]), 4),
                                                   "two_level": round(v[6] / (trials * v[0]), 6)},
               "low_latency_inter_node_bytes": {"tokens_per_rank": T_ll, "flat": int(v[7]), "two_level": int(v[8])},
               "step_ms": {"flat": round(statistics.median(tf) * 1e3, 1),
                           "two_level": round(statistics.median(tt) * 1e3, 1)},
               "link_ms_slowest_rank": {"flat": round(statistics.median(df) * 1e3, 1),
                                        "two_level": round(statistics.median(dt) * 1e3, 1)},
               "max_abs_diff": wl[0], "outputs_equal": wl[0] <= 1e-5,
               "nodes_per_token": [int(c) for c in v[9:]]}
        print("RESULT " + json.dumps(res), flush=True)
    shutdown(ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=6, type=int, metavar=("NODES", "T", "H", "TRIALS", "T_LL", "SLOW"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--slow", type=int, default=1, help="divide both link bandwidths by this (link-bound runs)")
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    from wideep.launch.cli.local import run_local_ranks
    trials = 3 if a.quick else 7
    detail = {}
    for ranks in map(int, a.sizes.split(",")):
        for nodes in map(int, a.nodes.split(",")):
            t0 = time.time()
            rc, text = run_local_ranks([], ranks, timeout_s=1200, capture=True,
                                       cmd=[sys.executable, os.path.abspath(__file__), "--worker", str(nodes),
                                            str(a.tokens), str(a.hidden), str(trials), "16", str(a.slow)])
            if rc:
                raise SystemExit(f"bench ranks ({ranks} ranks, {nodes} nodes) failed with status {rc}")
            r = json.loads([x for x in text.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
            r["wall_s"] = round(time.time() - t0, 1)
            detail[f"{ranks}x{nodes}"] = r
            print(f"{ranks} ranks, {nodes} nodes: inter bytes vs min {r['inter_node_bytes_vs_min']}, step ms "
                  f"{r['step_ms']} (links {r['link_ms_slowest_rank']}), equal {r['outputs_equal']} "
                  f"({r['max_abs_diff']:.1e}), nodes per token {r['nodes_per_token']}, {r['wall_s']} s",
                  file=sys.stderr, flush=True)
    rs = list(detail.values())
    out = {
        "inter_node_bytes_vs_min": {"two_level": max(r["inter_node_bytes_vs_min"]["two_level"] for r in rs),
                                    "flat": max(r["inter_node_bytes_vs_min"]["flat"] for r in rs),
                                    "flat_best": min(r["inter_node_bytes_vs_min"]["flat"] for r in rs)},
        "outputs_equal": all(r["outputs_equal"] for r in rs),
        "step_time_two_level_vs_flat": max(round(r["step_ms"]["two_level"] / r["step_ms"]["flat"], 3) for r in rs),
        "step_time_two_level_vs_flat_best": min(round(r["step_ms"]["two_level"] / r["step_ms"]["flat"], 3) for r in rs),
        "step_ms": {k: r["step_ms"] for k, r in detail.items()},
        "link": dict(LINK, intra_gbps=LINK["intra_gbps"] / a.slow, inter_gbps=LINK["inter_gbps"] / a.slow),
        "detail": detail}
    save("dispatch", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
