"""Dual-batch overlap at ep 4 on CPU/gloo with a simulated network (0, 200, 1000 us per all-to-all).

Per latency and phase (decode: 16 running sequences per rank; prefill: 4 fresh 48-token prompts
per rank), steps alternate DBO off / on (interleaved, barrier-aligned, all ranks in lockstep):
  T_off, T_on   median step time without / with the split,
  T_comm        time inside blocking dispatch/combine during the off steps (slowest rank),
  T_compute     T_off - T_comm,
  overlap_eff   (T_off - T_on) / min(T_comm, T_compute)   (1 = perfect hiding of the smaller one).
At 0 us it also runs dbo = "auto" against off (ratio of step times, after the switch has explored
both choices: its steady state). Note: 4 ranks share 2 cores here, so "compute" of one rank
competes with the others' — the efficiency is a lower bound.
split_compute_ratio: one MoE layer on the step's tokens as two halves vs at once (one process, no
communication): what splitting costs in compute before any overlap; on this CPU small batches are
bound by reading the expert weights, which each microbatch does again.
Last line: {"overlap_efficiency": {"0": ..., "200": ..., "1000": ...}, "auto_vs_off_at_0us": ...}.
    python bench/dbo.py [--quick] [--png out.png]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
LATENCIES_US = (0, 200, 1000)
PLAN = os.environ.get("WIDEEP_BENCH_PLAN", "1") == "1"   # 0: never the low-latency dispatch (A/B)


def _barrier(core):
    import torch.distributed as dist
    dist.barrier(group=core.ctx.cpu_group)


def _step(core, split: bool) -> tuple[float, float]:
    """One lockstep step on every rank -> (wall seconds, comm seconds of the blocking path)."""
    d = core.model.dispatcher
    comm0 = d.stats.comm_s
    import torch
    import torch.distributed as dist
    batch = core.scheduler.schedule()
    n = torch.tensor([sum(batch.num_tokens)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=core.ctx.cpu_group)  # as the engine's step sync
    from parallel import StepPlan
    plan = StepPlan.make(int(n), split, d.low_latency_max_tokens if PLAN else 0)
    _barrier(core)
    t0 = time.perf_counter()
    if batch.seqs:
        core.runner.execute(batch, plan)
    else:
        core.runner.dummy_step(plan)
    dt = time.perf_counter() - t0
    for s in batch.seqs:
        if s.finished:
            core.scheduler.finish(s)
    return dt, d.stats.comm_s - comm0


def _phase(core, phase: str, trials: int, auto=None) -> dict:
    import torch.distributed as dist
    import torch

    from engine.sampling_params import SamplingParams
    rank = core.ctx.rank
    times = {"off": [], "on": [], "auto": []}
    comm = []
    seq_id = [0]

    def add(n, prompt_len, max_tokens):
        for i in range(n):
            seq_id[0] += 1
            ids = [(7 * seq_id[0] + 13 * rank + j) % 250 + 2 for j in range(prompt_len)]
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            core.scheduler.add(core.make_sequence(f"{rank}-{seq_id[0]}", None, ids, sp, max_tokens))

    if phase == "decode":
        add(16, 16, 400)
        while any(s.prefilling for s in core.scheduler.running) or core.scheduler.waiting:
            _step(core, False)
    modes = ["off", "on"] + (["auto"] if auto is not None else [])
    if auto is not None:  # let the switch explore both choices first: the steady state is measured
        n = 16 if phase == "decode" else 192
        for _ in range(2 * auto.min_samples):
            if phase == "prefill":
                add(4, 48, 1)
            flag = torch.tensor([int(auto.decide(n, phase == "decode"))])
            dist.broadcast(flag, src=0, group=core.ctx.cpu_group)
            dt, _ = _step(core, bool(flag.item()))
            auto.record(n, phase == "decode", bool(flag.item()), dt)
            if phase == "prefill":
                for s in list(core.scheduler.running):
                    core.scheduler.finish(s)
    for _ in range(trials):
        for mode in modes:
            if phase == "prefill":
                add(4, 48, 1)
            split = mode == "on"
            if mode == "auto":
                flag = torch.tensor([int(auto.decide(16 if phase == "decode" else 192, phase == "decode"))])
                dist.broadcast(flag, src=0, group=core.ctx.cpu_group)  # rank 0's vote, as in the engine
                split = bool(flag.item())
            dt, c = _step(core, split)
            if mode == "auto":
                auto.record(16 if phase == "decode" else 192, phase == "decode", split, dt)
            times[mode].append(dt)
            if mode == "off":
                comm.append(c)
            if phase == "prefill":  # the 1-token prompts finished in the step; free what is left
                for s in list(core.scheduler.running):
                    core.scheduler.finish(s)
    out = {m: statistics.median(v) for m, v in times.items() if v}
    out["comm"] = statistics.median(comm)
    return out


def worker(model_dir: str, trials: int) -> None:
    import torch
    import torch.distributed as dist

    from dbo.auto import AutoSwitch
    from engine.core import EngineCore
    from parallel.comm_stream import SimulatedLink
    core = EngineCore(model_dir, progress=False, block_size=16, kv_cache_blocks=256, max_num_batched_tokens=512,
                      enable_prefix_caching=False, dbo={"enabled": True}, parallel={"dispatch_backend": "torch"})
    res = {}
    for lat in LATENCIES_US:
        link = SimulatedLink(latency_us=lat)
        for d in [core.model.dispatcher, *core.runner.overlap.dispatchers]:
            d.link = link if link.enabled else None
        for phase in ("decode", "prefill"):
            auto = AutoSwitch() if lat == 0 else None
            r = _phase(core, phase, trials, auto)
            # the slowest rank's comm time bounds what overlap can hide
            t = torch.tensor([r["comm"]])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=core.ctx.cpu_group)
            r["comm"] = float(t)
            res[f"{lat}/{phase}"] = r
            for s in list(core.scheduler.running) + list(core.scheduler.waiting):
                core.scheduler.finish(s)
    if core.ctx.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    from parallel import shutdown
    shutdown(core.ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2, metavar=("DIR", "TRIALS"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--png", default=None)
    ap.add_argument("--ep", type=int, default=4, help="ranks (dp = ep); the issue's setting is 4")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]))
        return
    from launch.local import run_local_ranks
    from launch.tiny import make_tiny_checkpoint
    trials = 8 if a.quick else 25
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, vocab_size=256, hidden_size=256, intermediate_size=512,
                             moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
                             n_group=4, topk_group=2, initializer_range=0.05)
        rc, text = run_local_ranks([], a.ep, timeout_s=900, capture=True,
                                   cmd=[sys.executable, os.path.abspath(__file__), "--worker", d, str(trials)])
        split_cost = _split_compute_ratio(d) if not rc else None
    if rc:
        raise SystemExit(f"bench ranks failed with status {rc}")
    res = json.loads([x for x in text.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    eff, table = {}, {}
    for lat in LATENCIES_US:
        per = []
        for phase in ("decode", "prefill"):
            r = res[f"{lat}/{phase}"]
            compute = max(r["off"] - r["comm"], 1e-9)
            e = (r["off"] - r["on"]) / max(min(r["comm"], compute), 1e-9)
            per.append(e)
            table[f"{lat}us/{phase}"] = {"t_off_ms": round(r["off"] * 1e3, 2), "t_on_ms": round(r["on"] * 1e3, 2),
                                         "t_comm_ms": round(r["comm"] * 1e3, 2),
                                         "t_compute_ms": round(compute * 1e3, 2), "overlap_efficiency": round(e, 3)}
            print(f"{lat:>5} us {phase:>7}: {table[f'{lat}us/{phase}']}", file=sys.stderr)
        eff[str(lat)] = round(statistics.mean(per), 3)
    autos = [res[f"0/{p}"]["auto"] / res[f"0/{p}"]["off"] for p in ("decode", "prefill")]
    print(f"split compute ratio (two halves / whole): {split_cost}", file=sys.stderr)
    if a.png:
        _plot(table, a.png)
    print(json.dumps({"overlap_efficiency": eff, "auto_vs_off_at_0us": round(statistics.mean(autos), 3),
                      "ep": a.ep, "split_compute_ratio": split_cost, "detail": table}))


def _split_compute_ratio(model_dir: str, trials: int = 15) -> dict:
    import torch

    from engine.build import load_model
    torch.set_num_threads(1)
    model = load_model(model_dir, progress=False)
    moe = next(l.mlp for l in model.model.layers if l.is_moe)
    out = {}
    with torch.inference_mode():
        for phase, T in (("decode", 16), ("prefill", 192)):
            x = torch.randn(T, model.cfg.hidden_size)
            whole, halves = [], []
            for _ in range(trials):  # interleaved
                t0 = time.perf_counter()
                moe(x)
                whole.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                moe(x[: T // 2])
                moe(x[T // 2:])
                halves.append(time.perf_counter() - t0)
            out[phase] = round(statistics.median(halves) / statistics.median(whole), 2)
    return out


def _plot(table: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    keys = list(table)
    x = range(len(keys))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [table[k]["t_off_ms"] for k in keys], 0.4, label="DBO off")
    ax.bar([i + 0.2 for i in x], [table[k]["t_on_ms"] for k in keys], 0.4, label="DBO on")
    ax.set_xticks(list(x), keys, rotation=20)
    ax.set_ylabel("step time (ms)")
    ax.set_title("wideep DBO, ep 4, CPU/gloo, simulated all-to-all latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
