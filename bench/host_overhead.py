"""Host overhead per decode step: the engine's own work around a near-zero model.

A 1-layer, hidden-64 DeepSeek-V3 (one MoE layer, 16 experts) decodes B sequences at once, so a step
costs almost nothing on the device and its time is scheduling, step metadata, sampling and output
objects. One engine per batch size; the batch sizes take turns for --rounds rounds (64, 256, 1024,
64, 256, ...), each round timing --steps `Engine.step()`s of B decodes (prefill steps excluded), so
a burst of load on this shared machine hits one round, not one batch size. Per batch size: the
median over rounds of the round's median step (wall time, and the thread's CPU time), and the best
round; the profile's top functions with --profile.

    python bench/host_overhead.py [--batches 64,256,1024] [--steps 20] [--rounds 3] [--profile]

Last line (JSON): {"host_ms_per_step": {"64": ..., "256": ..., "1024": ...}, "host_ms_best_round": {...},
"cpu_ms_per_step": {...}, "per_seq_us": {...}, "ratio_1024_vs_256": ..., "rounds": [...]}
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

from bench.results import save  # noqa: E402


class Bench:
    """One engine of `batch` sequences, decoding; round() times `steps` decode steps of it."""

    def __init__(self, model_dir: str, batch: int, steps: int, rounds: int):
        from engine import Engine, SamplingParams
        self.batch = batch
        self.eng = Engine(model_dir, max_num_seqs=batch, max_num_batched_tokens=max(8192, 4 * batch), block_size=64,
                          kv_cache_blocks=2 * batch + 8, enable_prefix_caching=False, progress=False)
        sp = SamplingParams(max_tokens=steps * rounds + 8, ignore_eos=True, output_kind="delta")
        for i in range(batch):
            self.eng.add_request(str(i), [2 + i % 200, 3, 4, 5], sp)
        self.eng.step()  # the requests reach the scheduler and their prompts (4 tokens each) prefill; not timed
        sched = self.eng.core.scheduler
        while any(s.prefilling for s in sched.running) or sched.waiting:
            self.eng.step()

    def round(self, steps: int, prof=None) -> tuple[float, float]:
        """-> (median wall ms, median CPU ms) of `steps` decode steps."""
        times, cpu = [], []
        if prof is not None:
            prof.enable()
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = self.eng.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            assert len(outs) == self.batch, (len(outs), self.batch)
        if prof is not None:
            prof.disable()
        return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from launch.tiny import make_tiny_checkpoint
    batches = [int(x) for x in a.batches.split(",")]
    rounds: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", num_hidden_layers=1, first_k_dense_replace=0, hidden_size=64)
        benches = {b: Bench(d, b, a.steps, a.rounds) for b in batches}
        profs = {}
        if a.profile:
            import cProfile
            profs = {b: cProfile.Profile() for b in batches}
        for r in range(a.rounds):
            for b in batches:
                rounds[b].append(benches[b].round(a.steps, profs.get(b)))
                print(f"round {r + 1} batch {b}: {rounds[b][-1][0]:.2f} ms per decode step", flush=True)
        for bench in benches.values():
            bench.eng.shutdown()
    for b, prof in profs.items():
        import io
        import pstats
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print(f"batch {b}:\n{s.getvalue()}", file=sys.stderr)
    ms = {b: statistics.median(w for w, _ in rs) for b, rs in rounds.items()}
    for b in batches:
        print(f"batch {b}: {ms[b]:.2f} ms per decode step ({ms[b] * 1e3 / b:.1f} us per sequence)", flush=True)
    out = {"host_ms_per_step": {str(b): round(v, 3) for b, v in ms.items()},
           "host_ms_best_round": {str(b): round(min(w for w, _ in rs), 3) for b, rs in rounds.items()},
           "cpu_ms_per_step": {str(b): round(statistics.median(c for _, c in rs), 3) for b, rs in rounds.items()},
           "per_seq_us": {str(b): round(v * 1e3 / b, 2) for b, v in ms.items()},
           "rounds": {str(b): [round(w, 3) for w, _ in rs] for b, rs in rounds.items()}}
    if 256 in ms and 1024 in ms:
        out["ratio_1024_vs_256"] = round(ms[1024] / ms[256], 2)
    save("host_overhead", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
