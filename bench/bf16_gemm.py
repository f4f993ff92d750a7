"""The CPU GEMM on bfloat16 weights, one thread: the C kernel's paths (AVX512-BF16 dot products, `dot`; where the
CPU has AMX tiles, the tiles, `tiles`, csrc/gemm_amx.c; widening to float32, `widen`), the float32 kernel, and
torch's F.linear in bfloat16 and float32, on decode shapes (1-64 rows: the weight stream) and prefill shapes
(128-2048 rows: compute). Trials interleave them (dot, tiles, widen, f32, torch_bf16, torch_f32, dot, ...) so that
load on a shared machine hits all; the best of each counts. cpu/linear.py's choice (the C kernel up to MAX_ROWS rows,
AMX_TILE_MAX_ROWS on the tiles, torch's bfloat16 GEMM past it) rests on this.
Kept (with --record): bench/results/bf16_gemm.json. Last line: JSON, per shape ms of each and the ratios f32 / dot, torch_bf16 / dot,
and on the tiles torch_bf16 / tiles.
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
from wideep.cpu import gemm  # noqa: E402

SHAPES = [(1, 4096, 4096), (2, 4096, 4096), (16, 4096, 4096), (16, 1024, 512), (64, 2048, 1024), (128, 2048, 2048),
          (512, 2048, 2048), (2048, 2048, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dot_ok, tiles_ok = gemm.bf16_dot_supported(), gemm.amx_supported()
    rows = []
    for M, N, K in SHAPES:
        x, w = torch.randn(M, K), torch.randn(N, K)
        xb, wb = x.bfloat16(), w.bfloat16()
        cases = {"dot": lambda: gemm.linear(x, wb), "tiles": lambda: gemm.linear(xb, wb),
                 "widen": lambda: gemm.linear(x, wb), "f32": lambda: gemm.linear(x, w),
                 "torch_bf16": lambda: F.linear(xb, wb), "torch_f32": lambda: F.linear(x, w)}
        if not dot_ok:
            del cases["dot"]
        if not tiles_ok:
            del cases["tiles"]
        if M > 512:   # the C float32 / widening kernels at prefill sizes: minutes, and never chosen there
            for name in ("widen", "f32", "torch_f32"):
                del cases[name]
        best = dict.fromkeys(cases, float("inf"))
        for trial in range(a.trials + 1):   # round 0 warms up, not counted
            for name, fn in cases.items():
                gemm.bf16_dot(name in ("dot", "tiles"))
                gemm.amx(name == "tiles")
                t0 = time.perf_counter()
                fn()
                if trial:
                    best[name] = min(best[name], time.perf_counter() - t0)
        gemm.bf16_dot(dot_ok)
        gemm.amx(tiles_ok)
        r = {"M": M, "N": N, "K": K, **{f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}}
        if dot_ok and "f32" in best:
            r["f32_over_dot"] = round(best["f32"] / best["dot"], 2)
        if dot_ok:
            r["torch_bf16_over_dot"] = round(best["torch_bf16"] / best["dot"], 2)
        if tiles_ok:
            r["torch_bf16_over_tiles"] = round(best["torch_bf16"] / best["tiles"], 2)
        print(r, flush=True)
        rows.append(r)
    res = {"bf16_dot_supported": dot_ok, "amx_tiles": tiles_ok, "trials": a.trials, "torch": torch.__version__,
           "shapes": rows}
    save("bf16_gemm", res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
