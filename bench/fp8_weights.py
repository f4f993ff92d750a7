"""FP8 block-quantised weights kept as stored on the CPU kernels (issue #28), one thread.

GEMM: the C kernel on e4m3 weights + 128 x 128 float32 scales (csrc/gemm_fp8.c: widened in registers) against
the same kernel on bfloat16 weights (its default path: AVX512-BF16 dot products where the CPU has them) and on
float32 weights, at decode rows (1 and 16: the weight stream) on DeepSeek-V3-like projection shapes, and the
routed-experts kernel of a decode step (64 experts of 2 x 512 x 1024 and 1024 x 512, 16 tokens top-6) in fp8,
bfloat16 and float32. Trials interleave the cases; the best of each counts. Those matrices stay in the
last-level cache between trials (this VM reports 480 MiB of L3); the cold rows sweep 64 copies (1 GiB of
fp8, 2 GiB of bfloat16) so that every read comes from memory, as a decode step's do. The float32 column is
gemm_tpl.h's kernel, whose loads (wideep.h ld(), a memcpy) GCC 12 compiles to a store and a reload per
vector on this CPU: it is not float32's ceiling.

Decode: that checkpoint served both ways (bfloat16 activations), the decode step's time (decode_rows).
Memory: a tiny V3 checkpoint (launch/tiny/checkpoint.py, fp8: every projection e4m3 + block scales) loaded in a fresh
process with quantization "auto" (fp8 kept), and dequantised at load ("none") in bfloat16 and float32: resident
set growth per parameter, and the bytes of the parameters themselves per parameter.
Kept (with --record): bench/results/fp8_weights.json. Last line: JSON.
    python bench/fp8_weights.py [--trials 15]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results import rss_kib, save  # noqa: E402
from wideep.cpu import gemm  # noqa: E402
from wideep.moe.fp8 import quantize_experts_fp8, quantize_fp8_block  # noqa: E402

# (rows, N, K): q_b_proj-like, o_proj-like, a dense MLP's down_proj-like (K not a multiple of 128 last)
SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (1, 7168, 2048), (16, 7168, 2048), (1, 2048, 4000), (16, 2048, 4000)]


def _best(cases: dict, trials: int) -> dict:
    best = dict.fromkeys(cases, float("inf"))
    for trial in range(trials + 1):   # round 0 warms up, not counted
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if trial:
                best[name] = min(best[name], time.perf_counter() - t0)
    return {f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}


def gemm_rows(trials: int) -> list[dict]:
    rows = []
    for M, N, K in SHAPES:
        x, w = torch.randn(M, K), torch.randn(N, K) * 0.05
        q, s = quantize_fp8_block(w)
        wb = w.bfloat16()
        r = {"M": M, "N": N, "K": K, **_best({"fp8": lambda: gemm.linear_fp8(x, q, s), "bf16": lambda: gemm.linear(x, wb),
                                              "f32": lambda: gemm.linear(x, w)}, trials)}
        r["bf16_over_fp8"] = round(r["bf16_ms"] / r["fp8_ms"], 2)
        r["f32_over_fp8"] = round(r["f32_ms"] / r["fp8_ms"], 2)
        r["fp8_weight_gb_per_s"] = round(N * K / r["fp8_ms"] / 1e6, 2)
        print(r, flush=True)
        rows.append(r)
    return rows


def cold_rows(trials: int, count: int) -> list[dict]:
    """The same kernels over `count` distinct copies of one 4096 x 4096 weight, each read once per sweep: a
    working set past the last-level cache, as a decode step's weights are (the rows above are cache-resident
    after the first trial). Per-matrix ms of the best sweep."""
    w = torch.randn(4096, 4096) * 0.05
    q, s = quantize_fp8_block(w)
    qs, wbs = [q.clone() for _ in range(count)], [w.bfloat16() for _ in range(count)]
    rows = []
    for M in (1, 16):
        x = torch.randn(M, 4096)
        r = {"M": M, "N": 4096, "K": 4096, "matrices": count,
             "fp8_mb": count * q.numel() / 2 ** 20, "bf16_mb": count * 2 * q.numel() / 2 ** 20,
             **_best({"fp8": lambda: [gemm.linear_fp8(x, qq, s) for qq in qs],
                      "bf16": lambda: [gemm.linear(x, wb) for wb in wbs]}, trials)}
        for k in ("fp8", "bf16"):
            r[f"{k}_ms"] = round(r[f"{k}_ms"] / count, 3)
        r["bf16_over_fp8"] = round(r["bf16_ms"] / r["fp8_ms"], 2)
        r["fp8_weight_gb_per_s"] = round(4096 * 4096 / r["fp8_ms"] / 1e6, 2)
        r["bf16_weight_gb_per_s"] = round(2 * 4096 * 4096 / r["bf16_ms"] / 1e6, 2)
        print(r, flush=True)
        rows.append(r)
    return rows


def experts_row(trials: int) -> dict:
    El, H, I, T, k = 64, 1024, 512, 16, 6
    w13, w2 = torch.randn(El, 2 * I, H) * 0.05, torch.randn(El, H, I) * 0.05
    q13, s13, q2, s2 = quantize_experts_fp8(w13, w2)
    b13, b2 = w13.bfloat16(), w2.bfloat16()
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(El)[:k] for _ in range(T)])
    wts = torch.rand(T, k)
    r = {"El": El, "H": H, "I": I, "T": T, "k": k, **_best({
        "fp8": lambda: gemm.experts(x, q13, q2, ids, wts, w13_scale=s13, w2_scale=s2, block=(128, 128)),
        "bf16": lambda: gemm.experts(x, b13, b2, ids, wts), "f32": lambda: gemm.experts(x, w13, w2, ids, wts)}, trials)}
    r["bf16_over_fp8"] = round(r["bf16_ms"] / r["fp8_ms"], 2)
    r["f32_over_fp8"] = round(r["f32_ms"] / r["fp8_ms"], 2)
    print(r, flush=True)
    return r


def decode_rows(model_dir: str, trials: int, batch: int = 8, prompt: int = 32, new: int = 32) -> dict:
    """Decode step of the same checkpoint served fp8 kept ("auto") and dequantised to bfloat16 ("none"): the
    time of `new` more tokens after the prefill, per step (generate with max_tokens new + 1 minus with 1), best
    of interleaved trials. The bfloat16 engine runs the fused decode plan, the fp8 one its operations."""
    from wideep.engine import LLM, SamplingParams
    prompts = [[(7 * b + 3 * i) % 4000 + 1 for i in range(prompt)] for b in range(batch)]
    engines = {"fp8": LLM(model_dir, dtype="bfloat16", progress=False, enable_prefix_caching=False,
                          quantization="auto"),
               "bf16": LLM(model_dir, dtype="bfloat16", progress=False, enable_prefix_caching=False,
                           quantization="none")}
    best = dict.fromkeys(engines, float("inf"))
    toks = {}
    for trial in range(trials + 1):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            t1 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True))
            t2 = time.perf_counter()
            toks[name] = [o.outputs[0].token_ids for o in outs]
            if trial:
                best[name] = min(best[name], ((t2 - t1) - (t1 - t0)) / new)
    r = {"batch": batch, "prompt": prompt, "new_tokens": new,
         **{f"{k}_decode_step_ms": round(v * 1e3, 2) for k, v in best.items()},
         "bf16_over_fp8": round(best["bf16"] / best["fp8"], 2),
         "decode_paths": {k: dict(llm.model.decode_plan.steps) for k, llm in engines.items()},
         "greedy_sequences_equal": sum(a == b for a, b in zip(toks["fp8"], toks["bf16"])) / batch}
    print(r, flush=True)
    return r


def _rss_child(model_dir: str, dtype: str, quantization: str) -> None:
    from wideep.engine.model.build import parse_dtype
    from wideep.engine.model.families import load_model
    before = rss_kib()
    model = load_model(model_dir, dtype=parse_dtype(dtype), progress=False, quantization=quantization)
    after = rss_kib()
    params = sum(p.numel() for p in model.parameters())
    scales = sum(p.numel() for n, p in model.named_parameters() if n.endswith("scale_inv"))
    weights = params - scales   # the block scales are the weights' metadata, not parameters of the model
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"dtype": dtype, "quantization": quantization, "fp8_weights": model.backends["fp8_weights"],
                      "params": weights, "scale_floats": scales, "rss_growth_mb": round((after - before) * 1024 / 1e6, 1),
                      "bytes_per_param": round((after - before) * 1024 / weights, 3),
                      "stored_bytes_per_param": round(stored / weights, 3)}))


def rss(model_dir: str, dtype: str, quantization: str) -> dict:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss", model_dir, dtype, quantization],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"the RSS measurement failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cold", type=int, default=64, help="copies of the 4096 x 4096 weight for the cold rows")
    ap.add_argument("--rss", nargs=3, metavar=("DIR", "DTYPE", "QUANTIZATION"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rss:
        _rss_child(*a.rss)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    res = {"bf16_dot": gemm.bf16_dot(), "trials": a.trials, "torch": torch.__version__, "gemm": gemm_rows(a.trials),
           "experts": experts_row(a.trials), "cold": cold_rows(max(3, a.trials // 3), a.cold)}
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    with tempfile.TemporaryDirectory() as d:
        h = a.hidden
        make_tiny_checkpoint(d, arch="v3", fp8=True, seed=0, vocab_size=4096, hidden_size=h, intermediate_size=4 * h,
                             moe_intermediate_size=h // 2, num_hidden_layers=a.layers, first_k_dense_replace=1,
                             num_attention_heads=8, num_key_value_heads=8, q_lora_rank=h // 2, kv_lora_rank=h // 4,
                             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32,
                             num_experts_per_tok=6, n_group=8, topk_group=4, max_position_embeddings=1024)
        res["decode"] = decode_rows(d, max(2, a.trials // 5))
        res["rss"] = {"fp8": rss(d, "bfloat16", "auto"), "bfloat16": rss(d, "bfloat16", "none"),
                      "float32": rss(d, "float32", "none")}
    res["rss_bytes_per_param_fp8"] = res["rss"]["fp8"]["bytes_per_param"]
    save("fp8_weights", res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
