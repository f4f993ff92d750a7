"""EPLB benchmark. (1) Planning on synthetic loads, 256 experts + 32 redundant slots at EP 8/32/144:
plan time and balancedness vs a plain greedy baseline, slots/bytes a ±20% drift moves with the
migration-aware plan vs a from-scratch one. (2) End to end on local CPU ranks (gloo) with a skewed
router: EPLB off vs on (after a rebalance), trials interleaved in one run; step time, (token,
expert) pairs per EP rank per layer, bytes moved per rebalance (migration vs scratch):
  - rank per core (the issue's setting): 2 ranks on the 2 cores, expert GEMMs dominating the step
    (moe_intermediate_size 4096: a token's 6 routed experts are ~85% of its FLOPs), where a rank's
    idle time is really idle and the busiest rank sets the pace;
  - the old settings, kept as a second table: 4 ranks (and 2) with moe_intermediate_size 512.
Step time is wall time (the target's measure; medians and lower quartiles of interleaved trials),
and, because other processes share these 2 cores, also the lockstep critical path of CPU time: per
stretch between two all-to-all starts, the CPU seconds of the slowest rank, summed (the step time
with a core per rank and an instant network; waiting costs no CPU time).
Last line: JSON with step_time_ratio_rank_per_core (on / off, 2 ranks, wall),
cpu_critical_path_ratio_rank_per_core, eplb_vs_off_step_time_ratio
(4 ranks, 512), bytes_moved_migration, bytes_moved_scratch, balancedness_before, balancedness_after
(measured per-rank load, EPLB off / on, 4 ranks).
    python bench/eplb.py [--quick] [--png bench/eplb.png] [--skip-old]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results import save  # noqa: E402

V3_EXPERT_BYTES = 3 * 7168 * 2048 + 3 * 56 * 16 * 4   # fp8 weights + fp32 128x128 block scales


def greedy_plan(w: torch.Tensor, P: int, G: int) -> torch.Tensor:
    """Baseline: give each spare slot to the expert with the most load per replica, then place the
    replicas heaviest first on the least-loaded GPU with room (and without that expert if possible)."""
    L, E = w.shape
    k, rows = P // G, []
    for l in range(L):
        cnt = torch.ones(E)
        for _ in range(P - E):
            cnt[int((w[l] / cnt).argmax())] += 1
        reps = sorted(((float(w[l, e] / cnt[e]), e) for e in range(E) for _ in range(int(cnt[e]))), reverse=True)
        load, items = [0.0] * G, [[] for _ in range(G)]
        for x, e in reps:
            room = [g for g in range(G) if len(items[g]) < k]
            g = min([g for g in room if e not in items[g]] or room, key=load.__getitem__)
            load[g] += x
            items[g].append(e)
        rows.append(sum(items, []))
    return torch.tensor(rows)


def planning(layers: int) -> dict:
    from wideep.eplb import balancedness, rebalance_experts
    from wideep.eplb.transfer import plan_moves
    g = torch.Generator().manual_seed(0)
    w = torch.exp(torch.randn(layers, 256, generator=g)) * 1000             # lognormal: hot head, cold tail
    drift = w * (1 + 0.2 * (2 * torch.rand(w.shape, generator=g, dtype=w.dtype) - 1))
    out = {}
    for ep in (8, 32, 144):
        nodes = max(1, ep // 8)
        t = time.perf_counter()
        p, _, _ = rebalance_experts(w, 288, 8, nodes, ep)
        plan_s = time.perf_counter() - t
        t = time.perf_counter()
        base = greedy_plan(w, 288, ep)
        greedy_s = time.perf_counter() - t
        t = time.perf_counter()
        sticky, _, _ = rebalance_experts(drift, 288, 8, nodes, ep, current_phy2log=p)
        migrate_s = time.perf_counter() - t
        fresh, _, _ = rebalance_experts(drift, 288, 8, nodes, ep)
        flat, _, _ = rebalance_experts(w, 288, 1, 1, ep)                      # global policy
        remote = {name: sum(m.remote for m in plan_moves(p, q, ep)) for name, q in (("migration", sticky),
                                                                                  ("scratch", fresh))}
        out[str(ep)] = {
            "policy": "hierarchical" if 8 % nodes == 0 else "global", "plan_s": round(plan_s, 3),
            "migration_plan_s": round(migrate_s, 3), "greedy_s": round(greedy_s, 3),
            "balancedness": round(float(balancedness(w, p, ep).mean()), 4),
            "balancedness_greedy": round(float(balancedness(w, base, ep).mean()), 4),
            "balancedness_global_policy": round(float(balancedness(w, flat, ep).mean()), 4),
            "drift_balancedness_migration": round(float(balancedness(drift, sticky, ep).mean()), 4),
            "drift_balancedness_scratch": round(float(balancedness(drift, fresh, ep).mean()), 4),
            "drift_slots_moved_migration": int((sticky != p).sum()), "drift_slots_moved_scratch": int((fresh != p).sum()),
            "drift_v3_bytes_migration": remote["migration"] * V3_EXPERT_BYTES,
            "drift_v3_bytes_scratch": remote["scratch"] * V3_EXPERT_BYTES}
        print(f"planning ep {ep}: {out[str(ep)]}", file=sys.stderr, flush=True)
    return {"layers": layers, "experts": 256, "physical": 288, "ep": out}


# -- end to end -------------------------------------------------------------------------------------
def _llm(model_dir: str, eplb_cfg, ctx=None):
    """An LLM whose model carries EPLB's placement, plus a controller driven here (the engine gets
    the config with enabled=False, so it does not rebalance on its own)."""
    import dataclasses

    from wideep.engine import LLM
    from wideep.eplb import EplbController
    llm = LLM(model_dir, progress=False, ctx=ctx, dispatch_backend="torch", enable_prefix_caching=False,
              kv_cache_memory=64 << 20, eplb=dataclasses.replace(eplb_cfg, enabled=False),
              parallel={"num_redundant_experts": eplb_cfg.num_redundant_experts})
    return llm, EplbController(llm.model, llm.ctx, eplb_cfg)


class _CpuMarks:
    """This process's CPU time at each all-to-all start of a dispatcher: the points where the ranks
    meet in lockstep. Between two of them a rank computes (waiting for peers costs no CPU time: gloo
    blocks), so the sum over segments of the slowest rank's CPU time is the step time the ranks would
    take with a core each and an instant network, whatever else runs on this machine."""

    def __init__(self, dispatcher):
        self.marks: list[float] = []
        for name in ("dispatch_start", "combine_start"):
            setattr(dispatcher, name, self._marked(getattr(dispatcher, name)))

    def _marked(self, start):
        def call(*args, **kwargs):
            self.marks.append(time.process_time())
            return start(*args, **kwargs)
        return call


def _critical_path(ctx, marks: list[float]) -> float:
    """Collective: marks from every rank (the same count: every rank enters every all-to-all) ->
    sum over segments of the largest CPU seconds any rank spent in it."""
    import torch.distributed as dist
    seg = torch.tensor(marks, dtype=torch.float64).diff()
    n = torch.tensor([len(seg), -len(seg)], dtype=torch.float64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    if n[0] != -n[1]:
        raise RuntimeError(f"ranks saw different numbers of all-to-alls ({int(-n[1])} .. {int(n[0])})")
    dist.all_reduce(seg, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return float(seg.sum())


def worker(model_dir: str, batch: int, prompt: int, trials: int, redundant: int) -> None:
    import torch.distributed as dist

    from wideep.engine import SamplingParams
    from wideep.eplb import EplbConfig, Placement, balancedness
    from wideep.eplb.rebalancer import plan_placement
    from wideep.eplb.transfer import expert_bytes, plan_moves
    off, rec_off = _llm(model_dir, EplbConfig(enabled=True, step_interval=10**9))          # records only
    on, rec_on = _llm(model_dir, EplbConfig(enabled=True, num_redundant_experts=redundant, step_interval=10**9),
                      ctx=off.ctx)
    g = torch.Generator().manual_seed(0)
    V, ep = off.config.vocab_size, off.ctx.ep_size

    def prompts():
        return torch.randint(2, V, (batch, prompt), generator=g).tolist()

    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    work = prompts()
    for llm in (off, on):
        llm.generate(work, sp)                                                    # warm-up + recorded load
    first = rec_on.rebalance()
    on.generate(prompts(), sp)                                                    # other prompts: drifted load
    state, drift = rec_on.placement, rec_on.global_load()
    L = state.num_layers
    scratch = plan_placement(drift, state, ep, rec_on.num_groups, rec_on.num_nodes, migration_aware=False)
    B = expert_bytes(list(rec_on.layers[0].experts.parameters()))
    scratch_bytes = sum(m.remote for m in plan_moves(state.phy2log, scratch.phy2log, ep)) * B
    second = rec_on.rebalance(drift)
    for c in (rec_off, rec_on):
        c.recorder.reset_rank_load()
    times = {"off": [], "on": []}
    cpu = {"off": [], "on": []}       # CPU seconds of the busiest rank over the whole generate
    path = {"off": [], "on": []}      # the lockstep critical path of CPU time (_CpuMarks)
    marks = {"off": _CpuMarks(off.model.dispatcher), "on": _CpuMarks(on.model.dispatcher)}
    moe_calls = {}
    for t in range(trials):
        for name in (("off", "on") if t % 2 == 0 else ("on", "off")):
            llm = off if name == "off" else on
            llm.model.dispatcher.stats.reset()
            m = marks[name].marks
            m.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            m.append(c0)
            llm.generate(work, sp)
            times[name].append(time.perf_counter() - t0)
            m.append(time.process_time())
            path[name].append(_critical_path(llm.ctx, m))
            c = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(c, op=dist.ReduceOp.MAX, group=llm.ctx.cpu_group)
            cpu[name].append(float(c))
            moe_calls[name] = llm.model.dispatcher.stats.dispatch_calls
    loads = {"off": rec_off.rank_load(), "on": rec_on.rank_load()}              # collective
    # the last generate of each: hidden bytes sent to other ranks, time in dispatch/combine (all ranks)
    comm = {name: llm.all_stats() for name, llm in (("off", off), ("on", on))}   # collective
    if off.ctx.rank == 0:
        steps = {k: v // L for k, v in moe_calls.items()}                         # forwards per generate
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        med_path = {k: statistics.median(v) for k, v in path.items()}
        # interference from other processes only slows a generate: the lower quartile is a second estimate
        q25 = {k: statistics.quantiles(v, n=4)[0] for k, v in times.items()}
        bal = {k: (v.double().mean(-1) / v.double().max(-1).values) for k, v in loads.items()}
        work_steps = min(steps.values())                                          # steps with tokens
        res = {"step_s_off": round(med["off"] / work_steps, 4), "step_s_on": round(med["on"] / work_steps, 4),
               "steps_per_generate": steps, "generate_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
               # the same prompts either way: the ratio of generate times is the ratio of step times (a
               # generate sometimes runs one more, empty, lockstep step on either side: see steps_per_generate)
               "eplb_vs_off_step_time_ratio": round(med["on"] / med["off"], 3),
               "eplb_vs_off_step_time_ratio_lower_quartile": round(q25["on"] / q25["off"], 3),
               "cpu_critical_path_s_per_generate": {k: round(v, 4) for k, v in med_path.items()},
               "eplb_vs_off_cpu_critical_path_ratio": round(med_path["on"] / med_path["off"], 3),
               "busiest_rank_cpu_s_per_generate": {k: round(v, 4) for k, v in med_cpu.items()},
               "eplb_vs_off_busiest_rank_cpu_ratio": round(med_cpu["on"] / med_cpu["off"], 3),
               "max_pairs_per_rank_off": loads["off"].max(-1).values.tolist(),
               "max_pairs_per_rank_on": loads["on"].max(-1).values.tolist(),
               "pairs_per_rank_off": loads["off"].tolist(), "pairs_per_rank_on": loads["on"].tolist(),
               "dispatch_bytes_remote": {k: sum(r["dispatch"]["dispatch_bytes_remote"] for r in v)
                                         for k, v in comm.items()},
               "comm_s_max_rank": {k: round(max(r["dispatch"]["comm_s"] for r in v), 3) for k, v in comm.items()},
               "balancedness_before": round(float(bal["off"].mean()), 4),
               "balancedness_after": round(float(bal["on"].mean()), 4),
               "first_rebalance": {k: first[k] for k in ("slots_moved", "bytes_moved", "plan_s", "transfer_s",
                                                         "swap_s", "balancedness_before_mean",
                                                         "balancedness_after_mean")},
               "bytes_moved_migration": second["bytes_moved"], "bytes_moved_scratch": scratch_bytes,
               "slots_moved_migration": second["slots_moved"],
               "slots_moved_scratch": int((scratch.phy2log != state.phy2log).sum()),
               "drift_balancedness_migration": round(second["balancedness_after_mean"], 4),
               "drift_balancedness_scratch": round(float(balancedness(drift, scratch.phy2log, ep).mean()), 4),
               "expert_bytes": B, "load": drift.tolist(), "phy2log_initial": Placement.initial(
                   L, state.num_experts, state.num_physical).phy2log.tolist(),
               "phy2log_final": rec_on.placement.phy2log.tolist()}
        print("RESULT " + json.dumps(res), flush=True)
    on.shutdown()


def skewed_checkpoint(out_dir: str, boost: float = 0.3, moe_intermediate_size: int = 512) -> str:
    """Tiny DeepSeek-V3 (32 experts, top-6, 4 groups; experts dominate the FLOPs) whose gate bias
    sends most tokens to 4 experts of one group and 2 of the next, a different group per layer."""
    from safetensors.torch import load_file, save_file

    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    make_tiny_checkpoint(out_dir, arch="v3", seed=0, vocab_size=1024, hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=moe_intermediate_size, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=6,
                         n_group=4, topk_group=2, initializer_range=0.05)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            base = 8 * (int(name.split(".")[2]) % 4)
            t[[base, base + 1, base + 2, base + 3, (base + 8) % 32, (base + 9) % 32]] += boost
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def end_to_end(quick: bool, ep: int, moe_intermediate_size: int = 512, batch: int = 16, trials: int = 7) -> dict:
    from wideep.launch.cli.local import run_local_ranks
    batch, prompt, trials = (batch // 2, 128, 4) if quick else (batch, 128, trials)
    redundant = ep  # one replica slot per rank: 32 + ep slots
    with tempfile.TemporaryDirectory() as d:
        skewed_checkpoint(d, moe_intermediate_size=moe_intermediate_size)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", d, str(batch), str(prompt), str(trials),
               str(redundant)]
        rc, text = run_local_ranks([], ep, timeout_s=1800, cmd=cmd, capture=True)
    if rc:
        raise SystemExit(f"end-to-end ranks failed with status {rc}")
    res = json.loads([x for x in text.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    res["workload"] = {"ep": ep, "batch": batch, "prompt": prompt, "max_tokens": 2, "trials": trials,
                       "experts": 32, "redundant": redundant, "topk": 6, "hidden": 256,
                       "moe_intermediate": moe_intermediate_size}
    print(f"end to end ep {ep}, moe_intermediate {moe_intermediate_size}: ratio {res['eplb_vs_off_step_time_ratio']}, "
          f"max pairs per rank off {res['max_pairs_per_rank_off']} on {res['max_pairs_per_rank_on']}",
          file=sys.stderr, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=5, metavar=("DIR", "BATCH", "PROMPT", "TRIALS", "REDUNDANT"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--png", default=None, help="write the per-rank load report here (needs matplotlib)")
    ap.add_argument("--skip-old", action="store_true", help="only the rank-per-core setting (no planning table)")
    ap.add_argument("--moe-intermediate", type=int, default=4096, help="of the rank-per-core setting's model")
    a = ap.parse_args()
    if a.worker:
        d, *nums = a.worker
        worker(d, *map(int, nums))
        return
    per_core = end_to_end(a.quick, 2, moe_intermediate_size=a.moe_intermediate, trials=11)
    out = {"step_time_ratio_rank_per_core": per_core["eplb_vs_off_step_time_ratio"],
           "step_time_ratio_rank_per_core_lower_quartile": per_core["eplb_vs_off_step_time_ratio_lower_quartile"],
           "cpu_critical_path_ratio_rank_per_core": per_core["eplb_vs_off_cpu_critical_path_ratio"],
           "busiest_rank_cpu_ratio_rank_per_core": per_core["eplb_vs_off_busiest_rank_cpu_ratio"]}
    runs = {"rank_per_core": per_core}
    if not a.skip_old:
        plan = planning(layers=16 if a.quick else 58)
        e2e = end_to_end(a.quick, 4)
        e2e_ep2 = end_to_end(a.quick, 2)  # 2 ranks on 2 cores, moe_intermediate 512
        if a.png:
            from wideep.launch.cli.eplb_cli import draw_report
            draw_report(torch.tensor(e2e["load"]), torch.tensor(e2e["phy2log_initial"]),
                        torch.tensor(e2e["phy2log_final"]), 4, a.png, title="bench/eplb.py: ep 4, skewed router")
        keys = ("eplb_vs_off_step_time_ratio", "bytes_moved_migration", "bytes_moved_scratch", "balancedness_before",
                "balancedness_after")
        out.update({k: e2e[k] for k in keys})
        out["eplb_vs_off_step_time_ratio_ep2"] = e2e_ep2[keys[0]]
        out["planning"] = plan
        runs.update(end_to_end=e2e, end_to_end_ep2=e2e_ep2)
    for r in runs.values():
        for k in ("load", "phy2log_initial", "phy2log_final", "pairs_per_rank_off", "pairs_per_rank_on"):
            r.pop(k)
    out = {**out, **runs, "cpus": os.cpu_count()}
    save("eplb", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
