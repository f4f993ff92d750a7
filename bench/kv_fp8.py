"""The fp8 (e4m3) and fp4 (e2m1, NVFP4-style) latent KV caches: bytes per token, logprob drift, and the C paged
MLA decode reading them vs a float32 cache.

Bytes per token at DeepSeek-V3's shape (61 layers, C 512 + R 64), for bf16 and float32 models, exact:
fp8 rows (attention_mla/fp8_cache.py) 512 e4m3 bytes + 4 float32 scales + the RoPE part in the model dtype;
fp4 rows (attention_mla/fp4_cache.py) 256 bytes of e2m1 + 32 e4m3 scales + a float32 token scale + the RoPE part.
Drift: a tiny DeepSeek-V3 checkpoint with V3's latent dims (kv_lora_rank 512, rope 64; 4 layers, hidden 256,
`--initializer-range` 0.05, seed 5) served by the engine with each kv_cache_dtype on the same `--prompts` random
prompts of 32-160 tokens: |prompt logprob - the full-precision cache's| (mean, max) and the teacher-forced
greedy choice (top-1 at every prompt position) equal to full precision's.
Timing: cpu/layers.py mla_decode (the "cpu" attention backend's decode kernel) over a paged cache of B
sequences at context L each, `--heads` heads, in float32, fp8 and fp4 rows, trials alternating, median of
the process's CPU time (one thread: other processes on a shared machine inflate wall time, not CPU time).

    python bench/kv_fp8.py [--contexts 1024,4096] [--batch 4] [--heads 16] [--trials 7] [--prompts 8]
                           [--initializer-range 0.05]
    python bench/kv_fp8.py --model v4 [--prompts 8]

--model v4 (bench/kv_fp8_v4.py): DeepSeek-V4's fp8 streams (attention_v4/fp8.py), saved as kv_fp8_v4.

Last line (JSON): {"bytes_per_token": {"bf16": {"auto": ..., "fp8": ..., "fp4": ...}, "float32": {...}},
"cache_ratio": {...}, "cache_ratio_fp4": {...}, "drift": {"fp8": {...}, "fp4": {...}}, "contexts": [...],
"fp32_ms": [...], "fp8_ms": [...], "fp4_ms": [...], "fp8_vs_fp32": [...], "fp4_vs_fp32": [...]}
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wideep.attention_mla.fp8_cache import latent_layout  # noqa: E402
from wideep.attention_mla.kv_cache import LatentKVPool  # noqa: E402
from bench.results import save  # noqa: E402

LAYERS, C, R = 61, 512, 64


KINDS = ("auto", "fp8", "fp4")


def bytes_per_token() -> dict:
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        out[name] = {kv: LatentKVPool.bytes_per_block(LAYERS, 1, C + R, dt, fp8=latent_layout(kv, C, R, dt))
                     for kv in KINDS}
    return out


def drift(num_prompts: int, init: float) -> dict:
    """kv_cache_dtype -> prompt-logprob drift against "auto" and teacher-forced greedy agreement."""
    from wideep.engine import LLM, SamplingParams
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(32, 160))] for _ in range(num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v3", seed=5, initializer_range=init, hidden_size=256, kv_lora_rank=C,
                             qk_rope_head_dim=R)
        for kv in KINDS:
            llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=8 * num_prompts + 16, kv_cache_dtype=kv)
            runs[kv] = [o.prompt_logprobs for o in llm.generate(prompts, sp)]
            llm.shutdown()
    out = {}
    for kv in KINDS[1:]:
        diffs, agree, total = [], 0, 0
        for ref, got, p in zip(runs["auto"], runs[kv], prompts):
            for j in range(1, len(p)):
                diffs.append(abs(got[j][p[j]] - ref[j][p[j]]))
                # prompt_logprobs=1: the top-1 and the prompt token, so the top-1 is the entry with the most
                agree, total = agree + (max(got[j], key=got[j].get) == max(ref[j], key=ref[j].get)), total + 1
        out[kv] = {"mean_abs_logprob_diff": round(statistics.mean(diffs), 4),
                   "max_abs_logprob_diff": round(max(diffs), 4), "greedy_agreement": round(agree / total, 4),
                   "tokens": total}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("v3", "v4"), default="v3")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the drift measurement (0: skip it)")
    # 0.1 at hidden 64 (tests/engine/test_fp8_kv_cache.py) scaled by sqrt(64 / 256); the drift of a random
    # model grows with its logits' scale (0.03: fp8 / fp4 mean 0.016 / 0.051 nats; 0.05: 0.043 / 0.126)
    ap.add_argument("--initializer-range", type=float, default=0.05, help="the drift model's weight scale")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.model == "v4":
        from bench.kv_fp8_v4 import run
        out = run(a.prompts)
        save("kv_fp8_v4", out)
        print(json.dumps(out))
        return
    from wideep.cpu.layers import mla_decode
    layouts = {"fp32": None, "fp8": latent_layout("fp8", C, R, torch.float32),
               "fp4": latent_layout("fp4", C, R, torch.float32)}
    bs, B = a.block_size, a.batch
    rows = {"contexts": [], "fp32_ms": [], "fp8_ms": [], "fp4_ms": []}
    for L in [int(x) for x in a.contexts.split(",")]:
        nblk = -(-L // bs)
        table = torch.randperm(B * nblk).view(B, nblk)
        latents = torch.randn(B * nblk * bs, C + R)
        pools = {k: latents if lay is None else lay.quantize(latents) for k, lay in layouts.items()}
        q = torch.randn(B, a.heads, C + R)
        lens = torch.full((B,), L, dtype=torch.int32)
        times = {k: [] for k in pools}
        for _ in range(a.trials):
            for k, pool in pools.items():
                t0 = time.process_time()
                mla_decode(q, pool, table, lens, bs, C, 0.04, L, layouts[k])
                times[k].append((time.process_time() - t0) * 1e3)
        rows["contexts"].append(L)
        for k in pools:
            rows[f"{k}_ms"].append(round(statistics.median(times[k]), 3))
    b = bytes_per_token()
    out = {"bytes_per_token": b, "cache_ratio": {k: round(v["auto"] / v["fp8"], 2) for k, v in b.items()},
           "cache_ratio_fp4": {k: round(v["auto"] / v["fp4"], 2) for k, v in b.items()},
           **({"drift": drift(a.prompts, a.initializer_range)} if a.prompts else {}),
           **rows, "fp8_vs_fp32": [round(x / y, 2) for x, y in zip(rows["fp8_ms"], rows["fp32_ms"])],
           "fp4_vs_fp32": [round(x / y, 2) for x, y in zip(rows["fp4_ms"], rows["fp32_ms"])],
           "batch": B, "heads": a.heads}
    save("kv_fp8", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
