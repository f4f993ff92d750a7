"""Kernel figures on one GPU, against ceilings measured in the same run. Prints and writes JSON.

  peak       bf16 torch.mm TFLOP/s (best of a few large square shapes): the compute ceiling
  copy       device-to-device copy GB/s, counting bytes read + written: the memory ceiling
  moe        Triton fused MoE at DeepSeek-V3 expert shapes (H 7168, I 2048, 256 experts, top-8),
             512 / 4096 / 16384 tokens, bf16 weights and fp8 block-quantised weights (in-kernel
             dequant); DeepGEMM too when it imports. TFLOP/s = 2*T*k*3*H*I / time, as a fraction of peak.
             At 16384 tokens a few alternative prefill tiles too (MOE_SWEEP), to tune the table with.
  mla        Triton paged MLA decode, batch 64 and 128, context 4096, 128 heads, kv_lora 512 + rope 64,
             bf16, block 64: GB/s = latent bytes read / time, as a fraction of copy bandwidth.
Each figure also carries its max relative error against the torch reference (on a subset).
Targets: >= 0.6 of the ceiling at the large sizes (moe 16384 tokens, mla batch 128).

    python bench/gpu_check.py [--out bench/gpu_check.json]       # GPU, < 5 minutes on an H200
    python bench/gpu_check.py --smoke --out /tmp/smoke.json     # CPU, tiny shapes, TRITON_INTERPRET=1
--smoke runs every code path above on tiny shapes (no timing meaning); CI runs it so this can't rot.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:  # before any kernel module is imported: triton.jit reads it at decoration
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MLA_ALT_TILES = ((64, 32, 8, 2), (64, 16, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2), (16, 64, 4, 3))  # heads, latents,
#             warps, stages: alternatives run after DecodeTiles' default (64x32/8/2 spills under Triton 3.9)
MOE_SWEEP = ((128, 128, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3), (64, 128, 128, 8, 4, 3), (128, 256, 64, 8, 8, 4))
#             block_m/n/k, group_m, warps, stages: alternatives to the table's prefill row, at the largest size
FULL = dict(mla_tiles=MLA_ALT_TILES, moe_sweep=MOE_SWEEP, matmul=(4096, 8192), copy_mib=2048,
            H=7168, I=2048, E=256, k=8, tokens=(512, 4096, 16384), fp8_tokens=(4096, 16384),
            heads=128, C=512, R=64, ctx=4096, batches=(64, 128), block=64, check_tokens=512, check_batch=8, target=0.6)
SMOKE = dict(mla_tiles=MLA_ALT_TILES[:1], moe_sweep=((16, 32, 32, 2, 1, 1),), matmul=(64,), copy_mib=1,
             H=64, I=32, E=8, k=2, tokens=(8, 24), fp8_tokens=(24,),
             heads=16, C=32, R=16, ctx=40, batches=(2, 3), block=16, check_tokens=8, check_batch=2, target=0.6)


def timed(fn, dev: torch.device, min_s: float) -> float:
    """Median-free mean seconds per call after a warm-up (CUDA events on GPU; one call on CPU)."""
    fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(3, min(200, int(min_s / max(start.elapsed_time(end) / 1e3, 1e-6))))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def ceilings(cfg, dev, dtype, min_s) -> dict:
    best = 0.0
    shapes = {}
    for n in cfg["matmul"]:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        t = timed(lambda: torch.mm(a, b), dev, min_s)
        shapes[str(n)] = 2 * n ** 3 / t / 1e12
        best = max(best, shapes[str(n)])
        del a, b
    src = torch.empty(cfg["copy_mib"] << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, min_s)
    copy = 2 * src.numel() / t / 1e9
    del src, dst
    return {"matmul_tflops": best, "matmul_by_n": shapes, "copy_gbps": copy}


def routing(T, E, k, dev):
    scores = torch.randn(T, E, device=dev)
    w, ids = scores.softmax(-1).topk(k, dim=-1)
    return ids, w.float()


def bench_moe(cfg, dev, peak, min_s) -> list[dict]:
    from wideep.moe.experts import Experts
    from wideep.moe.fp8 import quantize_experts_fp8
    from wideep.moe.tiles import MoETiles
    from wideep.moe.triton_moe import fused_moe
    H, I, E, k = cfg["H"], cfg["I"], cfg["E"], cfg["k"]
    dt = torch.bfloat16
    ex = Experts(E, H, I, device=dev, dtype=dt)
    with torch.no_grad():
        ex.w13.normal_(0, H ** -0.5)
        ex.w2.normal_(0, I ** -0.5)
    w13, w2 = ex.w13.data, ex.w2.data
    results = []

    def one(name, T, fn, ref_fn, **extra):
        x = torch.randn(T, H, device=dev, dtype=dt)
        ids, w = routing(T, E, k, dev)
        r = {"path": name, "tokens": T, **extra}
        try:  # one failing configuration (e.g. out of shared memory) must not lose the rest of the run
            t = timed(lambda: fn(x, ids, w), dev, min_s)
            r.update(ms=t * 1e3, tflops=2 * T * k * 3 * H * I / t / 1e12)
            r["fraction_of_peak"] = r["tflops"] / peak
            if T <= cfg["check_tokens"]:
                r["rel_err_vs_torch"] = rel_err(fn(x, ids, w), ref_fn(x, ids, w))
        except Exception as e:  # noqa: BLE001 - recorded in the JSON and fails the exit status
            r["error"] = repr(e)[:500]
        results.append(r)
        print(json.dumps(r), flush=True)

    for T in cfg["tokens"]:
        one("triton_bf16", T, lambda x, i, w: fused_moe(x, w13, w2, i, w), ex.forward_grouped)
    for bm, bn, bk, g, warps, stages in cfg["moe_sweep"]:
        tiles = MoETiles(bm, bn, bk, group_m=g, num_warps=warps, num_stages=stages)
        one("triton_bf16_sweep", max(cfg["tokens"]), lambda x, i, w: fused_moe(x, w13, w2, i, w, tiles=tiles),
            ex.forward_grouped, tiles=[bm, bn, bk, g, warps, stages])
    q13, s13, q2, s2 = quantize_experts_fp8(w13, w2)
    del ex, w13, w2
    fx = Experts(E, H, I, device=dev, dtype=dt, fp8_block=(128, 128))
    with torch.no_grad():
        fx.w13.copy_(q13), fx.w13_scale_inv.copy_(s13), fx.w2.copy_(q2), fx.w2_scale_inv.copy_(s2)
    del q13, s13, q2, s2
    fx.backend = "triton"
    for T in sorted(set(cfg["fp8_tokens"]) | {min(cfg["tokens"])}):
        one("triton_fp8", T, fx.forward_triton, fx.forward_grouped)
    from wideep.moe.deepgemm import load
    api = load() if dev.type == "cuda" else None
    if api is not None:
        fx.backend, fx.deepgemm = "deepgemm", api
        for T in cfg["tokens"]:
            one(f"deepgemm_{api.generation}", T, fx.forward_deepgemm, fx.forward_grouped)
    return results




def bench_mla(cfg, dev, copy_gbps, min_s) -> list[dict]:
    """DecodeTiles' default, then every other entry of cfg["mla_tiles"], per batch (untuned kernel: the
    sweep shows which way to go); the best of each batch is marked."""
    from wideep.attention_mla.paged_decode import paged_decode_reference
    from wideep.attention_mla.triton_decode import DecodeTiles, mla_decode
    N, C, R, L, bs = cfg["heads"], cfg["C"], cfg["R"], cfg["ctx"], cfg["block"]
    dt = torch.bfloat16
    d = DecodeTiles()
    default = (d.block_h, d.block_n, d.num_warps, d.num_stages)
    sweep = [default] + [t for t in cfg["mla_tiles"] if tuple(t) != default]
    results = []
    for B in cfg["batches"]:
        nblk = -(-L // bs)
        pool = torch.randn(B * nblk * bs, C + R, device=dev, dtype=dt)
        table = torch.randperm(B * nblk, device=dev).view(B, nblk).to(torch.int32)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        q = torch.randn(B, N, C + R, device=dev, dtype=dt)
        scale = 192 ** -0.5  # DeepSeek-V3's qk_head_dim
        nb = min(B, cfg["check_batch"])
        ref = paged_decode_reference(q[:nb].float(), pool.float(), table[:nb], [L] * nb, bs, C, scale)
        nbytes = B * L * (C + R) * pool.element_size()
        rows = []
        for bh, bn, warps, stages in sweep:
            tiles = DecodeTiles(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)
            r = {"batch": B, "context": L, "heads": N, "tiles": [bh, bn, warps, stages], "best": False}
            try:
                t = timed(lambda: mla_decode(q, pool, table, lens, bs, C, scale, L, tiles=tiles), dev, min_s)
                r.update(ms=t * 1e3, gbps=nbytes / t / 1e9)
                r["fraction_of_copy"] = r["gbps"] / copy_gbps
                got = mla_decode(q[:nb], pool, table[:nb], lens[:nb], bs, C, scale, L, tiles=tiles)
                r["rel_err_vs_torch"] = rel_err(got, ref)
            except Exception as e:  # noqa: BLE001 - recorded, fails the exit status
                r["error"] = repr(e)[:500]
            rows.append(r)
        ok = [r for r in rows if "error" not in r]
        if ok:
            max(ok, key=lambda r: r["gbps"])["best"] = True
        for r in rows:
            print(json.dumps(r), flush=True)
        results += rows
        del pool, q
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, interpreted Triton (CI)")
    ap.add_argument("--out", default="bench/gpu_check.json")
    ap.add_argument("--tests-rc", type=int, default=None, help="exit status of the GPU test run (from the .sh)")
    a = ap.parse_args(argv)
    if a.smoke:
        cfg, dev, min_s = SMOKE, torch.device("cpu"), 0.0
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --smoke for the CPU dry run)")
        cfg, dev, min_s = FULL, torch.device("cuda"), 0.3
    t0 = time.time()
    torch.manual_seed(0)
    out = {"smoke": a.smoke, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "gpu_tests_rc": a.tests_rc}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        raise SystemExit("gpu_check: triton is not installed (pip install 'wideep[triton]')")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save(complete: bool) -> None:  # after every section: a run cut short by its timeout keeps what it has
        out["complete"], out["seconds"] = complete, time.time() - t0
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)

    out["ceilings"] = ceilings(cfg, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, min_s)
    print(json.dumps(out["ceilings"]), flush=True)
    save(False)
    out["mla_decode"] = bench_mla(cfg, dev, out["ceilings"]["copy_gbps"], min_s)
    save(False)
    out["moe"] = bench_moe(cfg, dev, out["ceilings"]["matmul_tflops"], min_s)
    out["errors"] = [r for r in out["moe"] + out["mla_decode"] if "error" in r]
    big_moe = [r for r in out["moe"] if r["tokens"] == max(cfg["tokens"]) and not r["path"].endswith("_sweep")]
    big_mla = [r for r in out["mla_decode"] if r["batch"] == max(cfg["batches"]) and r["best"]]
    out["targets"] = {"fraction": cfg["target"],
                      "moe_large": {r["path"]: r.get("fraction_of_peak", 0) >= cfg["target"] for r in big_moe},
                      "mla_large": bool(big_mla) and all(r["fraction_of_copy"] >= cfg["target"] for r in big_mla),
                      "moe_large_best_sweep_fraction": max((r["fraction_of_peak"] for r in out["moe"]
                                                            if r["path"].endswith("_sweep") and "error" not in r),
                                                           default=None)}
    save(True)
    print(json.dumps({"targets": out["targets"], "errors": len(out["errors"]), "seconds": out["seconds"],
                      "out": a.out}), flush=True)
    if out["errors"]:
        raise SystemExit(f"gpu_check: {len(out['errors'])} measurements failed (see 'errors' in {a.out})")
    return out


if __name__ == "__main__":
    main()
