"""The CPU GEMM on bfloat16 weights, one thread: the C kernel's two paths (AVX512-BF16 dot products, `dot`, and
widening to float32, `widen`), the float32 kernel, and torch's F.linear in bfloat16 and float32, on decode
shapes (1-16 rows: the weight stream) and prefill shapes (128-512 rows: compute). Trials interleave the five
(dot, widen, f32, torch_bf16, torch_f32, dot, ...) so that load on a shared machine hits all; the best of each
counts. cpu/linear.py's choice (the C kernel up to MAX_ROWS rows, torch's bfloat16 GEMM past it) rests on this.
Kept: bench/results/bf16_gemm.json. Last line: JSON, per shape ms of each and the ratios f32 / dot, torch_bf16 / dot.
    python bench/bf16_gemm.py [--trials 15]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results import save  # noqa: E402
from cpu import gemm  # noqa: E402

SHAPES = [(1, 4096, 4096), (2, 4096, 4096), (16, 4096, 4096), (16, 1024, 512), (128, 2048, 2048), (512, 2048, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dot_ok = gemm.bf16_dot_supported()
    rows = []
    for M, N, K in SHAPES:
        x, w = torch.randn(M, K), torch.randn(N, K)
        xb, wb = x.bfloat16(), w.bfloat16()
        cases = {"dot": lambda: gemm.linear(x, wb), "widen": lambda: gemm.linear(x, wb),
                 "f32": lambda: gemm.linear(x, w), "torch_bf16": lambda: F.linear(xb, wb),
                 "torch_f32": lambda: F.linear(x, w)}
        if not dot_ok:
            del cases["dot"]
        best = dict.fromkeys(cases, float("inf"))
        for trial in range(a.trials + 1):   # round 0 warms up, not counted
            for name, fn in cases.items():
                if name in ("dot", "widen"):
                    gemm.bf16_dot(name == "dot")
                t0 = time.perf_counter()
                fn()
                if trial:
                    best[name] = min(best[name], time.perf_counter() - t0)
        gemm.bf16_dot(dot_ok)
        r = {"M": M, "N": N, "K": K, **{f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}}
        if dot_ok:
            r["f32_over_dot"] = round(best["f32"] / best["dot"], 2)
            r["torch_bf16_over_dot"] = round(best["torch_bf16"] / best["dot"], 2)
        print(r, flush=True)
        rows.append(r)
    res = {"bf16_dot_supported": dot_ok, "trials": a.trials, "torch": torch.__version__, "shapes": rows}
    save("bf16_gemm", res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
