"""Host overhead per decode step: the engine's own work around a near-zero model.

A 1-layer, hidden-64 DeepSeek-V3 (one MoE layer, 16 experts) decodes B sequences at once, so a step
costs almost nothing on the device and its time is scheduling, step metadata, sampling and output
objects. Reports the median wall time of an `Engine.step()` of B decodes (prefill steps excluded)
at each batch size (and the thread's CPU time, steadier than wall time on a shared machine), and the
profile's top functions with --profile.

    python bench/host_overhead.py [--batches 64,256,1024] [--steps 20] [--profile]

Last line (JSON): {"host_ms_per_step": {"64": ..., "256": ..., "1024": ...}, "cpu_ms_per_step": {...},
"per_seq_us": {...}, "ratio_1024_vs_256": ...}
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def measure(model_dir: str, batch: int, steps: int, profile: bool) -> dict:
    from engine import Engine, SamplingParams
    eng = Engine(model_dir, max_num_seqs=batch, max_num_batched_tokens=max(8192, 4 * batch), block_size=64,
                 kv_cache_blocks=batch + 8, enable_prefix_caching=False, progress=False)
    sp = SamplingParams(max_tokens=steps + 8, ignore_eos=True, output_kind="delta")
    for i in range(batch):
        eng.add_request(str(i), [2 + i % 200, 3, 4, 5], sp)
    eng.step()  # the requests reach the scheduler and their prompts (4 tokens each) prefill; not timed
    while any(s.prefilling for s in eng.core.scheduler.running) or eng.core.scheduler.waiting:
        eng.step()
    times, cpu = [], []
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        assert len(outs) == batch, (len(outs), batch)
    if prof is not None:
        prof.disable()
        import io
        import pstats
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print(s.getvalue(), file=sys.stderr)
    eng.shutdown()
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "per_seq_us": ms * 1e3 / batch, "cpu_ms": statistics.median(cpu) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from launch.tiny import make_tiny_checkpoint
    res = {}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", num_hidden_layers=1, first_k_dense_replace=0, hidden_size=64)
        for b in [int(x) for x in a.batches.split(",")]:
            res[b] = measure(d, b, a.steps, a.profile)
            print(f"batch {b}: {res[b]['ms']:.2f} ms per decode step ({res[b]['per_seq_us']:.1f} us per sequence)",
                  flush=True)
    out = {"host_ms_per_step": {str(b): round(r["ms"], 3) for b, r in res.items()},
           "cpu_ms_per_step": {str(b): round(r["cpu_ms"], 3) for b, r in res.items()},
           "per_seq_us": {str(b): round(r["per_seq_us"], 2) for b, r in res.items()}}
    if 256 in res and 1024 in res:
        out["ratio_1024_vs_256"] = round(res[1024]["ms"] / res[256]["ms"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
