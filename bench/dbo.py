"""Dual-batch overlap on CPU/gloo with a simulated network: the mechanism, then the old settings.

(1) Rank per core (the issue's setting): 2 ranks as 2 simulated nodes x 1 (`ranks_per_node = 1`;
dispatch `auto` = the two-level dispatcher, all MoE traffic on the inter-node tier), prefill-heavy
steps: 4 fresh prompts x 256 tokens = 1024 tokens per rank per step. The link is calibrated so that
communication ~ compute: first steps without a link measure the compute and the inter-node bytes
of a step (slowest rank), then the inter-node tier gets 50 us + the bandwidth that makes a step's
bytes take as long as its compute (bandwidth shared by the two microbatches: splitting cannot invent
any). Also decode steps (16 running sequences per rank; 5x the trials: short, noisy steps) for `auto`.
(2) The old settings, kept as a second table: ep 4 (--ep) on 2 cores, latency-only links of 0, 200,
1000 us; decode 16 sequences per rank, prefill 4 x 48-token prompts per rank.

Per setting and phase, steps alternate DBO off / on (/ auto), barrier-aligned, every rank in lockstep:
  T_off, T_on   median step time without / with the split,
  T_comm        time inside blocking dispatch/combine during the off steps (slowest rank),
  T_compute     T_off - T_comm,
  overlap_eff   (T_off - T_on) / min(T_comm, T_compute)   (1 = the smaller one fully hidden),
  auto          dbo = "auto" (rank 0's AutoSwitch decides, after its first trial of both; its
                re-checks are measured): step time / off,
                beside off_vs_off (a second "off" mode, the same host steps as auto: the noise floor).
Modes are shuffled per trial (the same order on every rank).
split_compute_ratio: one process, no communication, the same model and step run as two microbatches
vs at once (the compute the split adds before any overlap), at the table's step sizes.
Last line: {"overlap_efficiency_prefill_two_tier": .., "auto_vs_off": .. (worst phase, setting 1, medians; lower quartiles in the detail),
"split_compute_ratio_prefill_two_tier": .., "overlap_efficiency": {"0": .., "200": .., "1000": ..},
"auto_vs_off_at_0us": .., ...}.
    python bench/dbo.py [--quick] [--png out.png] [--skip-old]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.results import save  # noqa: E402

LATENCIES_US = (0, 200, 1000)
PLAN = os.environ.get("WIDEEP_BENCH_PLAN", "1") == "1"   # 0: never the low-latency dispatch (A/B)
# phase -> (sequences added per step, prompt tokens, max_tokens); decode: 16 running sequences
WORKLOADS = {"old": {"decode": (16, 16, 400), "prefill": (4, 48, 1)},
             "two_tier": {"decode": (16, 16, 900), "prefill": (4, 256, 1)}}
DECODE_TRIALS = 5   # x the prefill trials in the rank-per-core setting: decode steps are short and noisy


def _barrier(core):
    import torch.distributed as dist
    dist.barrier(group=core.ctx.cpu_group)


def _step(core, split: bool) -> tuple[float, float]:
    """One lockstep step on every rank -> (wall seconds, comm seconds of the blocking path)."""
    import torch
    import torch.distributed as dist

    from wideep.parallel import StepPlan
    d = core.model.dispatcher
    comm0 = d.stats.comm_s
    batch = core.scheduler.schedule()
    n = torch.tensor([sum(batch.num_tokens)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=core.ctx.cpu_group)  # as the engine's step sync
    plan = StepPlan.make(int(n), split, d.low_latency_max_tokens if PLAN else 0)
    _barrier(core)
    t0 = time.perf_counter()
    if batch.seqs:
        core.scheduler.apply(batch, core.runner.execute(batch, plan))   # the runner never mutates sequences
    else:
        core.runner.dummy_step(plan)
    return time.perf_counter() - t0, d.stats.comm_s - comm0


class _Work:
    """Adds this phase's requests; every rank the same shape of work."""

    def __init__(self, core, phase: str, shape: tuple[int, int, int]):
        self.core, self.phase, self.shape, self.n = core, phase, shape, 0

    def add(self) -> None:
        from wideep.engine.worker.messages import NewRequest
        from wideep.engine.sampling_params import SamplingParams
        count, prompt_len, max_tokens = self.shape
        rank = self.core.ctx.rank
        for _ in range(count):
            self.n += 1
            ids = [(7 * self.n + 13 * rank + j) % 250 + 2 for j in range(prompt_len)]
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            self.core.add_request(NewRequest(f"{rank}-{self.phase}-{self.n}", ids, sp, max_tokens, time.time()))

    def before_step(self) -> None:
        if self.phase == "prefill":
            self.add()

    def after_step(self) -> None:
        if self.phase == "prefill":   # the 1-token prompts finished in the step; free anything left
            for s in list(self.core.scheduler.running):
                self.core.scheduler.finish(s)

    @property
    def tokens(self) -> int:
        count, prompt_len, _ = self.shape
        return count if self.phase == "decode" else count * prompt_len


def _auto_decide(core, auto, work) -> bool:
    return _vote(core, auto.decide(work.tokens, work.phase == "decode"))


def _vote(core, split: bool) -> bool:
    import torch
    import torch.distributed as dist
    flag = torch.tensor([int(split)])
    dist.broadcast(flag, src=0, group=core.ctx.cpu_group)  # rank 0's vote, as in the engine
    return bool(flag.item())


def _phase(core, phase: str, shape, trials: int, auto=None) -> dict:
    work = _Work(core, phase, shape)
    if phase == "decode":
        work.add()
        while any(s.prefilling for s in core.scheduler.running) or core.scheduler.waiting:
            _step(core, False)
    # "off2" is off again: the A/A ratio off2/off is this machine's noise floor beside auto/off
    modes = ["off", "on"] + (["auto", "off2"] if auto is not None else [])
    if auto is not None:  # the bucket's first trial (both choices) runs first: the steady state is measured,
        for _ in range(auto.explore_steps):   # its later trials (re-checks) are in it
            work.before_step()
            split = _auto_decide(core, auto, work)
            dt, _ = _step(core, split)
            auto.record(work.tokens, phase == "decode", split, dt)
            work.after_step()
    times, comm, auto_splits = {m: [] for m in modes}, [], []
    for t in range(trials):
        order = list(modes)
        random.Random(t).shuffle(order)   # the same on every rank; no mode always follows another
        for mode in order:
            work.before_step()
            split = _auto_decide(core, auto, work) if mode == "auto" else mode == "on"
            if mode == "off2":   # the same host-side steps as an auto step that decided "off"
                split = _vote(core, False)
            dt, c = _step(core, split)
            if mode == "auto":
                auto.record(work.tokens, phase == "decode", split, dt)
                auto_splits.append(split)
            times[mode].append(dt)
            if mode == "off":
                comm.append(c)
            work.after_step()
    for s in list(core.scheduler.running) + list(core.scheduler.waiting):
        core.scheduler.finish(s)
    out = {m: statistics.median(v) for m, v in times.items()}
    # interference from other processes only ever slows a step: the lower quartile is a second,
    # less disturbed estimate of the same ratios
    out["p25"] = {m: statistics.quantiles(v, n=4)[0] for m, v in times.items()}
    out["comm"] = statistics.median(comm)
    if auto_splits:
        out["auto_split_fraction"] = sum(auto_splits) / len(auto_splits)
    return out


def _slowest(core, value: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=core.ctx.cpu_group)
    return float(t)


def _core(model_dir: str, par: dict, ctx=None, **network):
    """This rank's EngineCore, its dispatchers on the simulated network that `network` (ParallelConfig's
    simulated_* keys; none: no network) gives them at construction. ctx: the ranks an earlier core
    connected (a network is changed by building a core on it, never by reassigning a dispatcher's)."""
    from wideep.engine.worker.core import EngineCore
    return EngineCore.from_options(model_dir, ctx=ctx, progress=False, block_size=16, kv_cache_blocks=1200,
                                   max_num_batched_tokens=1024, enable_prefix_caching=False,
                                   dbo={"enabled": True}, parallel=dict(par, **network))


def worker(model_dir: str, setting: str, trials: int) -> None:
    import torch

    from wideep.dbo.auto import AutoSwitch
    from wideep.parallel import shutdown
    torch.set_num_threads(1)
    par = {"ranks_per_node": 1} if setting == "two_tier" else {"dispatch_backend": "torch"}
    core = _core(model_dir, par)
    res = {"dispatcher": type(core.model.dispatcher).__name__, "nodes": core.ctx.num_nodes}
    if setting == "two_tier":
        shape = WORKLOADS[setting]["prefill"]
        # calibrate: compute and inter-node bytes of an unsplit prefill step, no link
        cal = _phase(core, "prefill", shape, max(3, trials // 3))
        d = core.model.dispatcher
        b0 = d.stats.dispatch_bytes_inter + d.stats.combine_bytes_inter
        work = _Work(core, "prefill", shape)
        work.before_step()
        _step(core, False)
        work.after_step()
        step_bytes = _slowest(core, d.stats.dispatch_bytes_inter + d.stats.combine_bytes_inter - b0)
        compute = _slowest(core, cal["off"] - cal["comm"])
        gbps = step_bytes * 8 / (compute * 1e9)
        res["link"] = {"inter_us": 50.0, "inter_gbps": round(gbps, 4), "step_inter_bytes": int(step_bytes),
                       "calibration_compute_ms": round(compute * 1e3, 2)}
        core = _core(model_dir, par, core.ctx, simulated_inter_node_latency_us=50.0, simulated_inter_node_gbps=gbps)
        for phase in ("prefill", "decode"):
            n = trials * (DECODE_TRIALS if phase == "decode" else 1)
            r = _phase(core, phase, WORKLOADS[setting][phase], n, AutoSwitch())
            r["comm"] = _slowest(core, r["comm"])
            res[phase] = r
    else:
        for lat in LATENCIES_US:
            if lat:   # 0: the first core, on no network
                core = _core(model_dir, par, core.ctx, simulated_latency_us=float(lat))
            for phase in ("decode", "prefill"):
                r = _phase(core, phase, WORKLOADS[setting][phase], trials, AutoSwitch() if lat == 0 else None)
                r["comm"] = _slowest(core, r["comm"])  # the slowest rank's comm time bounds what overlap can hide
                res[f"{lat}/{phase}"] = r
    if core.ctx.rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    shutdown(core.ctx)


def _row(r: dict) -> dict:
    compute = max(r["off"] - r["comm"], 1e-9)
    e = (r["off"] - r["on"]) / max(min(r["comm"], compute), 1e-9)
    row = {"t_off_ms": round(r["off"] * 1e3, 2), "t_on_ms": round(r["on"] * 1e3, 2),
           "t_comm_ms": round(r["comm"] * 1e3, 2), "t_compute_ms": round(compute * 1e3, 2),
           "overlap_efficiency": round(e, 3)}
    if "auto" in r:
        row["auto_vs_off"] = round(r["auto"] / r["off"], 3)
        row["auto_split_fraction"] = round(r["auto_split_fraction"], 2)
        row["off_vs_off"] = round(r["off2"] / r["off"], 3)
        q = r["p25"]
        row["lower_quartile"] = {"auto_vs_off": round(q["auto"] / q["off"], 3),
                                 "off_vs_off": round(q["off2"] / q["off"], 3), "on_vs_off": round(q["on"] / q["off"], 3)}
    return row


def _run(model_dir: str, setting: str, ranks: int, trials: int) -> dict:
    from wideep.launch.cli.local import run_local_ranks
    rc, text = run_local_ranks([], ranks, timeout_s=1800, capture=True,
                               cmd=[sys.executable, os.path.abspath(__file__), "--worker", model_dir, setting,
                                    str(trials)])
    if rc:
        raise SystemExit(f"bench ranks ({setting}) failed with status {rc}")
    return json.loads([x for x in text.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3, metavar=("DIR", "SETTING", "TRIALS"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--png", default=None)
    ap.add_argument("--ep", type=int, default=4, help="ranks of the old-settings table (dp = ep)")
    ap.add_argument("--skip-old", action="store_true", help="only the rank-per-core setting")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], int(a.worker[2]))
        return
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    trials = 8 if a.quick else 20
    out = {}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, vocab_size=256, hidden_size=256, intermediate_size=512,
                             moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                             qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
                             n_group=4, topk_group=2, initializer_range=0.05, max_position_embeddings=1024)
        two = _run(d, "two_tier", 2, trials)
        split_two = _split_compute_ratio(d, WORKLOADS["two_tier"], trials)
        table = {p: _row(two[p]) for p in ("prefill", "decode")}
        for p, row in table.items():
            row["split_compute_ratio"] = split_two[p]
            print(f"2 ranks as 2 nodes x 1, {p}: {row}", file=sys.stderr, flush=True)
        out.update({"overlap_efficiency_prefill_two_tier": table["prefill"]["overlap_efficiency"],
                    "auto_vs_off": max(row["auto_vs_off"] for row in table.values()),
                    "split_compute_ratio_prefill_two_tier": split_two["prefill"],
                    "two_tier": {"dispatcher": two["dispatcher"], "nodes": two["nodes"], "link": two["link"],
                                 **table}})
        if not a.skip_old:
            old = _run(d, "old", a.ep, trials)
            split_old = _split_compute_ratio(d, WORKLOADS["old"], trials)
            eff, rows = {}, {}
            for lat in LATENCIES_US:
                per = []
                for phase in ("decode", "prefill"):
                    rows[f"{lat}us/{phase}"] = _row(old[f"{lat}/{phase}"])
                    per.append(rows[f"{lat}us/{phase}"]["overlap_efficiency"])
                    print(f"old, ep {a.ep}, {lat:>5} us {phase:>7}: {rows[f'{lat}us/{phase}']}", file=sys.stderr)
                eff[str(lat)] = round(statistics.mean(per), 3)
            out.update({"overlap_efficiency": eff,
                        "auto_vs_off_at_0us": round(statistics.mean(rows[f"0us/{p}"]["auto_vs_off"]
                                                                     for p in ("decode", "prefill")), 3),
                        "ep": a.ep, "split_compute_ratio": split_old, "detail": rows})
            if a.png:
                _plot(rows, a.png, a.ep)
    print(json.dumps(out))
    save("dbo", out)


def _split_compute_ratio(model_dir: str, workloads: dict, trials: int) -> dict:
    """One process (every expert local, no communication), DBO on: a step of the workload's size run
    split vs whole, interleaved -> median ratio per phase."""
    import torch

    from wideep.engine.worker.core import EngineCore
    from wideep.parallel import StepPlan
    torch.set_num_threads(1)
    core = EngineCore.from_options(model_dir, progress=False, block_size=16, kv_cache_blocks=1200,
                                   max_num_batched_tokens=1024, enable_prefix_caching=False, dbo={"enabled": True})
    out = {}
    for phase, shape in workloads.items():
        work = _Work(core, phase, shape)
        if phase == "decode":
            work.add()
            while any(s.prefilling for s in core.scheduler.running) or core.scheduler.waiting:
                batch = core.scheduler.schedule()
                core.scheduler.apply(batch, core.runner.execute(batch, StepPlan.make(sum(batch.num_tokens))))
        times = {False: [], True: []}
        for _ in range(trials):
            for split in (False, True):
                work.before_step()
                batch = core.scheduler.schedule()
                t0 = time.perf_counter()
                core.scheduler.apply(batch, core.runner.execute(batch, StepPlan.make(sum(batch.num_tokens), split)))
                times[split].append(time.perf_counter() - t0)
                work.after_step()
        for s in list(core.scheduler.running) + list(core.scheduler.waiting):
            core.scheduler.finish(s)
        out[phase] = round(statistics.median(times[True]) / statistics.median(times[False]), 3)
    return out


def _plot(table: dict, path: str, ep: int) -> None:
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
    ax.set_title(f"wideep DBO, ep {ep}, CPU/gloo, simulated all-to-all latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
