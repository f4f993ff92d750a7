"""Width: what each rank pays for the control plane at 1 .. 32 ranks on this machine.

For each rank count N (local ranks, sharing this host's cores; `--nodes K` simulates K nodes of N/K):
a tiny model with DeepSeek-V3's routing structure (256 experts in 8 groups, top-8 of 4 groups,
redundant slots), start, 32 short requests, stop. Measured, mostly counted rather than timed:
- startup_s: launch -> every rank's engine ready (CPU work on shared cores: at best linear in N);
- rss_mb: resident memory per rank, beside the parameter bytes it must hold (replicated + 1/ep experts);
- control per step on a worker: synchronous collectives other than the model's own all-to-alls
  (count and payload bytes) — the step sync's one fixed-size all-reduce, plus the two that end each
  wave (the idle step, the END command), spread over the wave's steps;
- store_ops_per_rank_s: rendezvous-store operations per rank per second while serving;
- front_ms_per_step: the front's time turning reports into outputs, per step of the lockstep (its
  waiting for reports excluded); tok/s;
- slow_front_ratio: the workers' mean step time with the front slowed by 50 ms per step (a sleep
  after each Engine.step) over the same without.

    python bench/scale.py [--ranks 1,2,4,8,16,32] [--requests 32] [--nodes 1] [--timeout 900]

Last line (JSON): {"startup_s": {"1": ...}, "control_bytes_per_step": {"2": ...}, "store_ops_per_rank_s": {...},
"slow_front_ratio": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import save  # noqa: E402

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather", "reduce", "barrier", "all_gather_object",
                "broadcast_object_list", "gather_object", "scatter", "reduce_scatter", "all_gather_into_tensor")


def _count_collectives(counts: dict) -> None:
    """Wrap torch.distributed's synchronous collectives (not all_to_all: the model's own) with counters."""
    import torch
    import torch.distributed as dist

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if counts.get("on"):
                c = counts.setdefault(name, [0, 0])
                c[0] += 1
                t = args[0] if args else None
                if isinstance(t, torch.Tensor):
                    c[1] += t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(model_dir: str, out_dir: str, requests: int, ranks_per_node: int) -> None:
    counts: dict = {}
    _count_collectives(counts)
    t_launch = float(os.environ["WIDEEP_BENCH_T0"])
    from wideep import Engine, SamplingParams
    parallel = {"num_redundant_experts": 0, "timeout_s": 300}
    if ranks_per_node:
        parallel["ranks_per_node"] = ranks_per_node
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=256, max_num_seqs=64, parallel=parallel)
    ready = time.time() - t_launch
    ctx, loop = eng.job_ctx, eng.loop
    res = {"rank": ctx.rank, "ready_s": ready, "param_bytes": eng.core.model.param_bytes()}
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[2 + (7 * i + j) % 200 for j in range(6 + i % 5)] for i in range(requests)]
    for phase, slow_s in (("warm", 0.0), ("fast", 0.0), ("slow", 0.05), ("fast2", 0.0)):
        step_times: list[float] = []
        loop.on_step = step_times.append
        store0 = _store_ops(ctx)
        counts.clear()
        counts["on"] = True
        t0 = time.time()
        front_s, front_steps, generated = 0.0, 0, 0
        busy0 = eng.front.busy_s if eng.is_front else 0.0
        if eng.is_front:
            for i, p in enumerate(prompts):
                eng.add_request(f"{phase}-{i}", p, sp)
            while eng.has_unfinished_requests():
                t = time.perf_counter()
                outs = eng.step()
                front_s += time.perf_counter() - t
                front_steps += 1
                generated += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
                if slow_s:
                    time.sleep(slow_s)
            eng.end_worker_loop()
        else:
            eng.run_worker_loop()
        dt = time.time() - t0
        counts["on"] = False
        steps = max(1, len(step_times))
        sync = {k: v for k, v in counts.items() if k != "on"}
        res[phase] = {"seconds": dt, "steps": len(step_times),
                      "step_ms_mean": 1e3 * sum(step_times) / steps,
                      "sync_collectives_per_step": sum(v[0] for v in sync.values()) / steps,
                      "sync_bytes_per_step": sum(v[1] for v in sync.values()) / steps,
                      "sync_by_kind": sync, "store_ops": _store_ops(ctx) - store0,
                      "front_ms_per_step": 1e3 * ((eng.front.busy_s - busy0) if eng.is_front else 0.0) / steps,
                      "front_wait_ms_per_call": 1e3 * front_s / max(1, front_steps), "generated": generated}
    res["rss_mb"] = _rss_mb()
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(res, f)
    eng.shutdown() if eng.is_front else None
    if not eng.is_front:
        eng.run_worker_loop()


def _store_ops(ctx) -> int:
    """Store operations this process made so far (the watchdog's counting store; 0 if unknown)."""
    wd = ctx.watchdog
    stats = wd.stats() if wd is not None and hasattr(wd, "stats") else {}
    return int(stats.get("store_ops", 0))


def run(n: int, model_dir: str, requests: int, nodes: int, timeout_s: float) -> dict:
    from wideep.launch.cli.local import start_ranks
    out = tempfile.mkdtemp(prefix=f"wideep-scale{n}-")
    rpn = n // nodes if nodes > 1 else 0
    cmd = [sys.executable, __file__, "--worker", model_dir, out, str(requests), str(rpn)]
    t0 = time.time()
    env = dict(os.environ, WIDEEP_BENCH_T0=str(t0), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if n == 1:
        import subprocess
        procs = [subprocess.Popen(cmd, env=env)]
    else:
        procs = start_ranks(cmd, n, env)
    deadline = time.time() + timeout_s
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()  # by pid: only what this run started
    rcs = [p.wait() for p in procs]
    total = time.time() - t0
    ranks = []
    for r in range(n):
        path = os.path.join(out, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    if any(rc != 0 for rc in rcs) or any(r is None for r in ranks):
        return {"ok": False, "returncodes": rcs, "total_s": total}
    front = ranks[0]
    workers = ranks[1:] or ranks
    fast = [w["fast"]["step_ms_mean"] for w in workers] + [w["fast2"]["step_ms_mean"] for w in workers]
    slow = [w["slow"]["step_ms_mean"] for w in workers]
    fast_s = front["fast"]["seconds"]
    return {"ok": True, "total_s": total, "startup_s": max(r["ready_s"] for r in ranks),
            "rss_mb": sum(r["rss_mb"] for r in ranks) / n,
            "param_mb": sum(r["param_bytes"]["total"] for r in ranks) / n / 2**20,
            "expert_param_mb": sum(r["param_bytes"]["experts"] for r in ranks) / n / 2**20,
            "control_collectives_per_step": max(w["fast"]["sync_collectives_per_step"] for w in workers),
            "control_bytes_per_step": max(w["fast"]["sync_bytes_per_step"] for w in workers),
            "control_bytes_per_sync": max(w["fast"]["sync_bytes_per_step"] / max(w["fast"]["sync_collectives_per_step"], 1e-9)
                                          for w in workers),
            "sync_by_kind": workers[-1]["fast"]["sync_by_kind"],
            "store_ops_per_rank_s": max(w["fast"]["store_ops"] / w["fast"]["seconds"] for w in workers),
            "front_ms_per_step": front["fast"]["front_ms_per_step"],
            "tok_s": front["fast"]["generated"] / fast_s,
            "worker_step_ms": sum(fast) / len(fast), "worker_step_ms_slow_front": sum(slow) / len(slow),
            "slow_front_ratio": (sum(slow) / len(slow)) / (sum(fast) / len(fast))}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,2,4,8,16,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args()
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    results = {}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=0, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1,
                             n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8,
                             moe_intermediate_size=32)
        for n in [int(x) for x in a.ranks.split(",")]:
            r = run(n, d, a.requests, a.nodes if n % a.nodes == 0 and n >= a.nodes else 1, a.timeout)
            results[n] = r
            print(f"{n} ranks: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                               for k, v in r.items() if k != "sync_by_kind"}), flush=True)
    ok = {n: r for n, r in results.items() if r.get("ok")}
    multi = {n: r for n, r in ok.items() if n > 1}

    def per(key, src=ok):
        return {str(n): round(r[key], 4) for n, r in src.items()}
    summary = {"startup_s": per("startup_s"), "total_s": per("total_s"), "rss_mb": per("rss_mb"),
               "param_mb": per("param_mb"), "control_collectives_per_step": per("control_collectives_per_step", multi),
               "control_bytes_per_step": per("control_bytes_per_step", multi),
               "control_bytes_per_sync": per("control_bytes_per_sync", multi),
               "store_ops_per_rank_s": per("store_ops_per_rank_s", multi), "front_ms_per_step": per("front_ms_per_step"),
               "tok_s": per("tok_s"), "slow_front_ratio_by_ranks": per("slow_front_ratio", multi),
               "slow_front_ratio": round(max((r["slow_front_ratio"] for r in multi.values()), default=float("nan")), 3),
               "failed": sorted(n for n, r in results.items() if not r.get("ok"))}
    if "8" in summary["startup_s"] and "32" in summary["startup_s"]:
        summary["startup_32_vs_8"] = round(summary["startup_s"]["32"] / summary["startup_s"]["8"], 2)
    save("scale", summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
