"""DeepSeek-V4's FP4 routed experts kept packed on the CPU kernels (issue #28), one thread.

Kernel: the routed-experts kernel of a decode step (64 experts of 2 x 512 x 1024 and 1024 x 512, top-6, 1 and 16
tokens) on FP4 weights (e2m1 pairs + an e8m0 byte per 32, csrc/gemm_fp4.c), FP8 (e4m3 + 128 x 128 float32
scales), bfloat16 and float32, with V4's clamped SwiGLU. Warm: the same weights every trial (they stay in the
last-level cache); cold: a sweep over `--cold` copies of each (past the cache: every read from memory, as a decode
step's are), per-copy ms of the best sweep; at 1 token only the 6 experts it picks are read (~5 MB of fp4 a
copy), so its cold row stays cache-resident unless --cold is far larger. Trials interleave the cases; the best of each counts.
Memory: a V4 checkpoint (launch/tiny/v4.py, widened; its routed experts quantised to FP4 as DeepSeek stores them,
the rest float32) loaded in a fresh process with quantization "auto" (FP4 kept packed) and "none" (dequantised to
float32 at load): resident-set growth, the routed experts' stored bytes per parameter, and the RSS growth less the
other parameters' bytes per routed-expert parameter. Decode: that checkpoint served both ways, the decode step's
time (decode_rows).
Last line: JSON (not kept (with --record) in bench/results/: run it to see).
    python bench/fp4_experts.py [--trials 10] [--cold 12]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.results import rss_kib  # noqa: E402
from wideep.cpu import gemm  # noqa: E402
from wideep.moe.fp4 import quantize_fp4  # noqa: E402
from wideep.moe.fp8 import quantize_experts_fp8  # noqa: E402

LIMIT = 10.0   # DeepSeek-V4's swiglu_limit
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def _best(cases: dict, trials: int) -> dict:
    best = dict.fromkeys(cases, float("inf"))
    for trial in range(trials + 1):   # round 0 warms up, not counted
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if trial:
                best[name] = min(best[name], time.perf_counter() - t0)
    return {f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}


def _fp4_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    E, R, K = w.shape
    q, s = quantize_fp4(w.reshape(E * R, K))
    return q.view(E, R, K // 2), s.view(E, R, K // 32)


def _weights(El: int, H: int, I: int) -> dict:
    w13, w2 = torch.randn(El, 2 * I, H) * 0.05, torch.randn(El, H, I) * 0.05
    q13, s13, q2, s2 = quantize_experts_fp8(w13, w2)
    (p13, e13), (p2, e2) = _fp4_stack(w13), _fp4_stack(w2)
    return {"fp4": (p13, p2, dict(w13_scale=e13, w2_scale=e2)),
            "fp8": (q13, q2, dict(w13_scale=s13, w2_scale=s2, block=(128, 128))),
            "bf16": (w13.bfloat16(), w2.bfloat16(), {}), "f32": (w13, w2, {})}


def _bytes(ws) -> int:
    return sum(t.numel() * t.element_size() for t in (ws[0], ws[1], *ws[2].values()) if isinstance(t, torch.Tensor))


def experts_rows(trials: int, cold: int) -> list[dict]:
    El, H, I, k = 64, 1024, 512, 6
    weights = _weights(El, H, I)
    rows = []
    for T in (1, 16):
        x = torch.randn(T, H)
        ids = torch.stack([torch.randperm(El)[:k] for _ in range(T)])
        wts = torch.rand(T, k)
        cases = {n: (lambda w=w: gemm.experts(x, w[0], w[1], ids, wts, limit=LIMIT, **w[2])) for n, w in weights.items()}
        r = {"El": El, "H": H, "I": I, "T": T, "k": k, "cache": "warm", **_best(cases, trials)}
        rows.append(r)
        print(r, flush=True)
    params = El * 3 * H * I
    per = {n: round(_bytes(w) / params, 4) for n, w in weights.items()}
    print({"stored_bytes_per_param": per}, flush=True)
    # cold: `cold` copies of each (f32 left out: 400 MB a copy), each read once per sweep
    copies = {n: [tuple(t.clone() for t in w[:2]) + ({a: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                       for a, v in w[2].items()},) for _ in range(cold)]
              for n, w in weights.items() if n != "f32"}
    for T in (1, 16):
        x = torch.randn(T, H)
        ids = torch.stack([torch.randperm(El)[:k] for _ in range(T)])
        wts = torch.rand(T, k)
        cases = {n: (lambda cs=cs: [gemm.experts(x, c[0], c[1], ids, wts, limit=LIMIT, **c[2]) for c in cs])
                 for n, cs in copies.items()}
        r = {"El": El, "H": H, "I": I, "T": T, "k": k, "cache": "cold", "copies": cold,
             **{n: round(v / cold, 3) for n, v in _best(cases, max(2, trials // 3)).items()}}
        touched = len(set(ids.view(-1).tolist())) / El   # only the experts with tokens are read
        r.update({f"{n}_weight_gb_per_s": round(touched * _bytes(weights[n]) / r[f"{n}_ms"] / 1e6, 2) for n in copies})
        rows.append(r)
        print(r, flush=True)
    del copies
    return rows + [{"stored_bytes_per_param": per}]


def make_v4_fp4(out_dir: str, hidden: int, inter: int, experts: int) -> None:
    """A widened tiny V4 saved by transformers, its routed experts rewritten as FP4 pairs + e8m0 scales."""
    from safetensors.torch import load_file, save_file
    from wideep.launch.tiny.v4 import tiny_v4_model
    model = tiny_v4_model(0, hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                          num_hidden_layers=2, layer_types=["sliding_attention"] * 2, mlp_layer_types=["moe"] * 2)
    model.save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    saved, out = load_file(path), {}
    for name, w in saved.items():
        if EXPERT.search(name):
            q, s = quantize_fp4(w)
            out[name], out[name[:-len("weight")] + "scale"] = q.view(torch.int8), s.view(torch.float8_e8m0fnu)
        else:
            out[name] = w
    save_file(out, path)
    cfg_path = os.path.join(out_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    json.dump(cfg, open(cfg_path, "w"))


def decode_rows(model_dir: str, trials: int, batch: int = 8, prompt: int = 32, new: int = 32) -> dict:
    """That checkpoint served with FP4 experts packed ("auto": the C experts kernel) and dequantised to float32 at
    load ("none": torch's experts; "none_cpu": the C experts kernel on the float32 weights): the decode step's time (generate with max_tokens new + 1 minus with 1, per
    token), best of interleaved trials, and whether the greedy tokens agree."""
    from wideep.engine import LLM, SamplingParams
    prompts = [[(7 * b + 3 * i) % 190 + 2 for i in range(prompt)] for b in range(batch)]
    engines = {name: LLM(model_dir, dtype="float32", progress=False, enable_prefix_caching=False, quantization=q,
                         experts_backend=b)
               for name, q, b in (("auto", "auto", "auto"), ("none", "none", "auto"), ("none_cpu", "none", "cpu"))}
    best, toks = dict.fromkeys(engines, float("inf")), {}
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
         "none_over_auto": round(best["none"] / best["auto"], 2),
         "none_cpu_over_auto": round(best["none_cpu"] / best["auto"], 2),
         "greedy_sequences_equal": {k: sum(a == b for a, b in zip(toks["auto"], toks[k])) / batch
                                    for k in ("none", "none_cpu")}}
    for llm in engines.values():
        llm.shutdown()
    print(r, flush=True)
    return r


def _rss_child(model_dir: str, quantization: str) -> None:
    from wideep.engine.model.families import load_model
    before = rss_kib()
    model = load_model(model_dir, progress=False, quantization=quantization)
    growth = (rss_kib() - before) * 1024
    ex = [layer.ffn.experts for layer in model.layers]
    n_expert = sum(e.num_local * 3 * e.hidden * e.intermediate for e in ex)
    expert_bytes = sum(p.numel() * p.element_size() for e in ex for p in e.parameters())
    other = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_bytes
    print(json.dumps({"quantization": quantization, "fp4_experts": model.backends["fp4_experts"],
                      "expert_params": n_expert, "rss_growth_mb": round(growth / 1e6, 1),
                      "expert_stored_bytes_per_param": round(expert_bytes / n_expert, 4),
                      "rss_bytes_per_expert_param": round((growth - other) / n_expert, 3)}))


def rss(model_dir: str, quantization: str) -> dict:
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss", model_dir, quantization],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"the RSS measurement failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--cold", type=int, default=12, help="copies of the experts for the cold rows")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rss", nargs=2, metavar=("DIR", "QUANTIZATION"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rss:
        _rss_child(*a.rss)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    res = {"bf16_dot": gemm.bf16_dot(), "trials": a.trials, "experts": experts_rows(a.trials, a.cold)}
    with tempfile.TemporaryDirectory() as d:
        make_v4_fp4(d, a.hidden, a.hidden, a.experts)
        res["rss"] = {q: rss(d, q) for q in ("auto", "none")}
        res["decode"] = decode_rows(d, max(2, a.trials // 5))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
