"""Surviving a lost rank (on_rank_loss = "continue") at 4, 8 and 16 local ranks.

A tiny model with DeepSeek-V3's routing structure (64 experts in 8 groups, top-8 of 4, one redundant
slot per rank) serves 32 streaming greedy requests; the rank in the middle is SIGKILLed at a fixed
model step. Measured per rank count, in one run each (loss, then a run without it, same requests):
- recovery_s: the kill -> the first token any request produced after it (the survivors stall: every
  step of every rank waits on the lockstep all-reduce, which the loss breaks);
- tok/s before the loss and after the recovery; requests lost (must be 0); outputs equal to the run
  without the loss; expert bytes fetched again from surviving peers and from the checkpoint.

    python bench/elastic.py [--ranks 4,8,16] [--requests 32] [--timeout 900]

Last line (JSON): {"recovery_s": {"4": ..., "8": ..., "16": ...}, "requests_lost": 0, "outputs_equal": true, ...}
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results import save  # noqa: E402


def worker(model_dir: str, out_dir: str, requests: int, victim: int, kill_step: int) -> None:
    from wideep.engine.front.engine import Engine
    from wideep.engine.sampling_params import SamplingParams
    rank = int(os.environ["RANK"])
    if rank == victim:
        import wideep.engine.worker.runner as runner
        execute, steps = runner.ModelRunner.execute, {"n": 0}

        def dying(self, *a, **k):
            steps["n"] += 1
            if steps["n"] == kill_step:
                with open(os.path.join(out_dir, "killed"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return execute(self, *a, **k)
        runner.ModelRunner.execute = dying
    world = int(os.environ.get("WORLD_SIZE", "1"))
    eng = Engine(model_dir, progress=False, block_size=8, kv_cache_blocks=256, max_num_seqs=64,
                 parallel={"on_rank_loss": "continue", "num_redundant_experts": world, "timeout_s": 60.0,
                           "heartbeat_s": 0.5})
    if not eng.is_front:
        eng.run_worker_loop()
        return
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, output_kind="delta")
    for i in range(requests):
        eng.add_request(f"r{i}", [2 + (7 * i + j) % 200 for j in range(6 + i % 7)], sp)
    times: list[tuple[float, int]] = []
    tokens: dict[str, list[int]] = {}
    finished = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            n = len(o.outputs[0].token_ids)
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if n:
                times.append((time.time(), n))
            finished += o.finished
    m = eng.metrics()
    eng.shutdown()
    with open(os.path.join(out_dir, "front.json"), "w") as f:
        json.dump({"tokens": tokens, "times": times, "finished": finished, "recoveries": m["recoveries"],
                   "readmitted": m["requests_readmitted"]}, f)


def _run(n: int, model_dir: str, requests: int, victim: int, kill_step: int, timeout_s: float) -> dict:
    from wideep.launch.cli.local import start_ranks
    out = tempfile.mkdtemp(prefix=f"wideep-elastic{n}-")
    cmd = [sys.executable, __file__, "--worker", model_dir, out, str(requests), str(victim), str(kill_step)]
    procs = start_ranks(cmd, n, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    deadline = time.time() + timeout_s
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()   # by pid: only what this run started
    rcs = [p.wait() for p in procs]
    path = os.path.join(out, "front.json")
    if not os.path.exists(path):
        return {"ok": False, "returncodes": rcs}
    res = json.load(open(path))
    killed = float(open(os.path.join(out, "killed")).read()) if os.path.exists(os.path.join(out, "killed")) else None
    res.update(ok=True, returncodes=rcs, killed=killed)
    return res


def measure(n: int, model_dir: str, requests: int, timeout_s: float) -> dict:
    victim, kill_step = n // 2, 12
    lossy = _run(n, model_dir, requests, victim, kill_step, timeout_s)
    clean = _run(n, model_dir, requests, -1, 0, timeout_s)
    if not (lossy["ok"] and clean["ok"]) or lossy["killed"] is None:
        return {"ok": False, "lossy_returncodes": lossy.get("returncodes"), "clean_returncodes": clean.get("returncodes")}
    t_kill = lossy["killed"]
    times = lossy["times"]
    before = [(t, k) for t, k in times if t < t_kill]
    after = [(t, k) for t, k in times if t > t_kill]
    first_after = after[0][0] if after else float("nan")
    recovered_at = first_after
    t0 = times[0][0]
    tok_before = sum(k for _, k in before) / max(t_kill - t0, 1e-9)
    tok_after = sum(k for _, k in after[1:]) / max(after[-1][0] - first_after, 1e-9) if len(after) > 1 else 0.0
    rec = lossy["recoveries"][0] if lossy["recoveries"] else {}
    return {"ok": True, "recovery_s": recovered_at - t_kill, "reform_s": rec.get("reform_s"),
            "recovery_s_ranks": rec.get("recovery_s"), "tok_s_before": tok_before, "tok_s_after": tok_after,
            "requests_lost": requests - lossy["finished"], "readmitted": lossy["readmitted"],
            "outputs_equal": lossy["tokens"] == clean["tokens"],
            "expert_bytes_peer": rec.get("expert_bytes_peer", 0),
            "expert_bytes_checkpoint": rec.get("expert_bytes_checkpoint", 0)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args()
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    results = {}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=2, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1,
                             n_routed_experts=64, n_group=8, topk_group=4, num_experts_per_tok=8,
                             moe_intermediate_size=32, initializer_range=0.3)
        for n in [int(x) for x in a.ranks.split(",")]:
            results[n] = r = measure(n, d, a.requests, a.timeout)
            print(f"{n} ranks: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}),
                  flush=True)
    ok = {n: r for n, r in results.items() if r.get("ok")}
    out = {"recovery_s": {str(n): round(r["recovery_s"], 3) for n, r in ok.items()},
           "reform_s": {str(n): round(r["reform_s"] or 0.0, 3) for n, r in ok.items()},
           "tok_s_before": {str(n): round(r["tok_s_before"], 1) for n, r in ok.items()},
           "tok_s_after": {str(n): round(r["tok_s_after"], 1) for n, r in ok.items()},
           "expert_bytes_peer": {str(n): r["expert_bytes_peer"] for n, r in ok.items()},
           "expert_bytes_checkpoint": {str(n): r["expert_bytes_checkpoint"] for n, r in ok.items()},
           "requests_lost": sum(r["requests_lost"] for r in ok.values()),
           "outputs_equal": all(r["outputs_equal"] for r in ok.values()) and len(ok) == len(results),
           "failed": sorted(n for n, r in results.items() if not r.get("ok"))}
    save("elastic", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
