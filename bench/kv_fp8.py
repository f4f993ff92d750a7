"""The fp8 (e4m3) latent KV cache: bytes per token, and the C paged MLA decode reading it vs a float32 cache.

Bytes per token at DeepSeek-V3's shape (61 layers, C 512 + R 64; attention_mla/fp8_cache.py's packed rows:
512 e4m3 bytes + 4 float32 scales + the RoPE part in the model dtype), for bf16 and float32 models, exact.
Timing: cpu/layers.py mla_decode (the "cpu" attention backend's decode kernel) over a paged cache of B
sequences at context L each, `--heads` heads, in float32 and in fp8 rows, trials alternating, median of the
process's CPU time (one thread: other processes on a shared machine inflate wall time, not CPU time).

    python bench/kv_fp8.py [--contexts 1024,4096] [--batch 4] [--heads 16] [--trials 7]

Last line (JSON): {"bytes_per_token": {"bf16": {"auto": ..., "fp8": ...}, "float32": {...}},
"cache_ratio": {...}, "contexts": [...], "fp32_ms": [...], "fp8_ms": [...], "fp8_vs_fp32": [...]}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_mla.fp8_cache import Fp8Latent  # noqa: E402
from attention_mla.kv_cache import LatentKVPool  # noqa: E402
from bench.results import save  # noqa: E402

LAYERS, C, R = 61, 512, 64


def bytes_per_token() -> dict:
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        out[name] = {kv: LatentKVPool.bytes_per_block(LAYERS, 1, C + R, dt, fp8=Fp8Latent(C, R, dt) if kv == "fp8"
                                                      else None) for kv in ("auto", "fp8")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from cpu.layers import mla_decode
    fp8, bs, B = Fp8Latent(C, R), a.block_size, a.batch
    rows = {"contexts": [], "fp32_ms": [], "fp8_ms": []}
    for L in [int(x) for x in a.contexts.split(",")]:
        nblk = -(-L // bs)
        table = torch.randperm(B * nblk).view(B, nblk)
        latents = torch.randn(B * nblk * bs, C + R)
        pools = {"fp32": latents, "fp8": fp8.quantize(latents)}
        q = torch.randn(B, a.heads, C + R)
        lens = torch.full((B,), L, dtype=torch.int32)
        times = {k: [] for k in pools}
        for _ in range(a.trials):
            for k, pool in pools.items():
                t0 = time.process_time()
                mla_decode(q, pool, table, lens, bs, C, 0.04, L, fp8 if k == "fp8" else None)
                times[k].append((time.process_time() - t0) * 1e3)
        rows["contexts"].append(L)
        for k in pools:
            rows[f"{k}_ms"].append(round(statistics.median(times[k]), 3))
    b = bytes_per_token()
    out = {"bytes_per_token": b, "cache_ratio": {k: round(v["auto"] / v["fp8"], 2) for k, v in b.items()},
           **rows, "fp8_vs_fp32": [round(x / y, 2) for x, y in zip(rows["fp8_ms"], rows["fp32_ms"])],
           "batch": B, "heads": a.heads}
    save("kv_fp8", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
