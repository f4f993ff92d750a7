"""nn.Linear whose decode-sized calls run the streaming C kernel (cpu/gemm.py); bigger ones F.linear.

A decode step multiplies each weight by a handful of rows: then reading the weight is the cost, and
the kernel reads it at close to memory speed where BLAS small-M GEMMs reach about a third of it.
Past MAX_ROWS rows the work per weight byte is high enough that BLAS (MKL) is as fast or faster.
bfloat16 weights: the kernel reads them as stored (float32 sums) up to MAX_ROWS rows; on AMX tiles (gemm.amx,
csrc/gemm_amx.c) up to AMX_TILE_MAX_ROWS; on a CPU with AMX tiles whose C kernels do not use them, 16
(AMX_BF16_MAX_ROWS); past it, torch's bfloat16 F.linear (oneDNN's AVX512-BF16 or AMX GEMM: bench/bf16_gemm.py
measures it against ours).
FP8 block-quantised weights (small_linear_fp8, for moe/fp8_linear.py Fp8Linear): the kernel reads the e4m3
bytes as stored up to MAX_ROWS rows; past it, F.linear over a copy dequantised for the call (in x's dtype:
the GEMM's work per weight dwarfs one pass that widens it).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import gemm, tune

MAX_ROWS = 64
# bfloat16 weights where the CPU has AMX tiles (amx_bf16) but the C kernels do not use them (gemm.amx off): oneDNN's
# bfloat16 GEMM runs on them and overtakes the C kernel's dot products past a handful of rows. Measured (1 thread,
# this Xeon with AMX): C / oneDNN 0.4-0.6x at 1-4 rows, ~1.1x at 8, 1.6x at 12, 2.1x at 16, 3.5-5x at 32-64 for one
# GEMM; in the engine's decode step (the fused layer calls against the operations on oneDNN) the crossover lies
# between 16 and 24 rows: 16 it is.
AMX_BF16_MAX_ROWS = 16
# ... and where the C kernels run on the tiles themselves (gemm.amx on, csrc/gemm_amx.c): one GEMM on the C tiles
# against oneDNN's (1 thread, this Xeon, weights of the vs_vllm model's shapes): 0.5-0.7x the time at 1-64 rows,
# about even at 128-384; past that oneDNN's tuned kernels lead (1.3-1.6x at 2048 rows) for shapes it has seen
# before, while every new row count costs it a JIT compile of several ms.
AMX_TILE_MAX_ROWS = 256
# the most rows any weight dtype's C path takes (the decode plan's first check, before it knows the dtype)
ROWS_CAP = max(MAX_ROWS, AMX_TILE_MAX_ROWS)
# The routed experts (moe/experts.py Experts.forward_cpu, "cpu"): the mean rows per local expert up to which the C
# kernel runs them, past which forward_grouped's BLAS GEMMs do. Float32 (and FP8 / FP4 weights, read as stored):
# 0.5-0.9x BLAS's time up to 384 rows. bfloat16 weights with bfloat16 activations where the CPU has bf16 dot
# products (1 thread, H 1024, I 256, 32 experts top-6, this Xeon): C / BLAS 0.76x at 3 rows per expert, 0.85x at 12,
# 1.12x at 24, 2.3x at 96; on AMX tiles the C kernel takes every batch: it gathers no rows into copies and compiles
# nothing per shape, where oneDNN JIT-compiles a kernel for each new row count (most of a prefill's expert time).
EXPERTS_MAX_ROWS = 256
EXPERTS_MAX_ROWS_BF16 = 16


def amx_bf16() -> bool:
    """Whether this CPU has AMX bfloat16 tiles (/proc/cpuinfo's amx_bf16; WIDEEP_CPU_AMX=0|1 overrides)."""
    global _AMX
    if _AMX is None:
        env = os.environ.get("WIDEEP_CPU_AMX")
        if env is not None:
            _AMX = env not in ("0", "")
        else:
            try:
                with open("/proc/cpuinfo") as f:
                    _AMX = "amx_bf16" in f.read().split()
            except OSError:
                _AMX = False
    return _AMX


_AMX: bool | None = None


def builtin_max_rows(weight_dtype: torch.dtype) -> int:
    """The most rows a call with weights of this dtype runs on the C kernel by the constants above (measured on an
    AVX-512 / AMX Xeon)."""
    if weight_dtype == torch.bfloat16:
        if gemm.amx_on():
            return AMX_TILE_MAX_ROWS
        if amx_bf16():
            return AMX_BF16_MAX_ROWS
    return MAX_ROWS


def max_rows(weight_dtype: torch.dtype) -> int:
    """The most rows a call with weights of this dtype runs on the C kernel (then BLAS / oneDNN): the built-in
    limit, or less where this machine measured the C slower (cpu/tune.py; 0: never)."""
    return min(builtin_max_rows(weight_dtype),
               tune.limit("linear_bf16" if weight_dtype == torch.bfloat16 else "linear_f32"))


@functools.lru_cache(maxsize=1)
def _dot_cpu() -> bool:
    """Whether this CPU has AVX512-BF16 (then BLAS's bfloat16 GEMMs run dot products; without, they convert)."""
    return gemm.bf16_dot_supported()


def builtin_experts_max_rows(weight_dtype: torch.dtype, x_dtype: torch.dtype) -> int | None:
    """The mean rows per local expert up to which the experts kernel runs a batch by the constants above (None:
    every batch)."""
    if weight_dtype == torch.bfloat16 and x_dtype == torch.bfloat16 and _dot_cpu():
        return None if gemm.amx_on() else EXPERTS_MAX_ROWS_BF16
    return EXPERTS_MAX_ROWS


def experts_max_rows(weight_dtype: torch.dtype, x_dtype: torch.dtype) -> int | None:
    """The mean rows per local expert up to which the experts kernel runs a batch (None: every batch): the built-in
    limit, or less where this machine measured the C slower (cpu/tune.py; 0: never). FP8 / FP4 weights keep the
    built-in limit: the kernel reads them as stored, where torch's GEMMs would need a dequantised copy."""
    built = builtin_experts_max_rows(weight_dtype, x_dtype)
    if weight_dtype not in (torch.float32, torch.bfloat16):
        return built
    tuned = tune.limit("experts_bf16" if weight_dtype == torch.bfloat16 else "experts_f32")
    if built is None:
        return None if tuned >= tune.EXPERT_ROWS[-1] else tuned
    return min(built, tuned)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] = F.linear(x, weight, bias) in x's dtype, the kernel when x has
    at most max_rows(weight.dtype) rows and x and weight are float32 or bfloat16 CPU tensors (float32 sums, the
    bias added in float32, one rounding to a bfloat16 x's dtype at the end)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if (rows > max_rows(weight.dtype) or rows == 0 or x.dtype not in gemm.WDT or weight.dtype not in gemm.WDT
            or x.device.type != "cpu" or weight.stride(-1) != 1):
        if weight.dtype != x.dtype:   # weights of another dtype than the rows (a bfloat16 MTP drafter's): a copy
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        if x.dtype == torch.bfloat16 and rows and x.device.type == "cpu" and tune.limit("bf16_widen"):
            # this CPU measured torch's bfloat16 GEMM slower than float32 copies (cpu/tune.py: no bf16 dot products)
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        return F.linear(x, weight, bias)
    y = gemm.linear(x.reshape(rows, K), weight)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear's parameters and signature (checkpoints load as usual); forward through small_linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_linear(x, self.weight, self.bias)


def small_linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] float8_e4m3fn with scale_inv [ceil(N/br), ceil(K/bk)] float32 -> [..., N] in x's
    dtype = F.linear(x, dequantize_fp8_block(weight, scale_inv, block), bias) (moe/fp8.py), float32 sums. The
    block along K must be a multiple of 16 (gemm.check_fp8 says so otherwise)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if rows == 0:
        # an idle EP rank's zero-token step: nothing to read (a dequantised copy here cost that rank every fp8
        # weight's read and a bfloat16 copy's write per step: 2 ranks ran 0.39x of 1 at batch 1)
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    if rows > MAX_ROWS or x.dtype not in gemm.WDT:
        w = gemm.dequantize_fp8(weight, scale_inv, block, x.dtype if x.dtype in gemm.WDT else torch.float32)
        return F.linear(x, w.to(x.dtype), bias)
    y = gemm.linear_fp8(x.reshape(rows, K), weight, scale_inv, block)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


# -- measured against torch on this machine (cpu/tune.py) ---------------------------------------------------------
def _measure_linear(dt: torch.dtype):
    """tune's measure(cap) for the streamed GEMM with weights of dtype dt against F.linear: a 2048 x 1024 weight,
    the weights streamed from memory, by rows."""
    def measure(cap: int):
        K, N = 1024, 2048
        x_all = torch.randn(tune.LINEAR_ROWS[-1], K, generator=torch.Generator().manual_seed(0))
        ws = tune.streamed(N, K, dt)

        def at(m):
            x = x_all[:m]
            xt = x.to(dt)
            return tune.compare(tune.rotating(ws, lambda w: gemm.linear(x, w)),
                                tune.rotating(ws, lambda w: F.linear(xt, w)))
        return tune.run_of_wins(tune.LINEAR_ROWS, cap, at)
    return measure


EXPERTS, HIDDEN, INTER, TOPK = 16, 1024, 256, 4
PAD_LIMIT = 16   # as moe/experts.py's forward_grouped: padded bmm up to this many rows per expert, else a GEMM each


def grouped_experts(x, w13, w2, ids, wts):
    """The torch side of the experts comparison: moe/experts.py forward_grouped's operations."""
    E = w13.shape[0]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    sid = flat[order]
    counts = torch.bincount(sid, minlength=E)
    rows = order // ids.shape[1]
    xs = x[rows]
    ch = counts.tolist()
    if max(ch) <= PAD_LIMIT:
        starts = torch.cumsum(counts, 0) - counts
        within = torch.arange(len(order)) - starts[sid]
        padded = x.new_zeros(E, max(ch), x.shape[1])
        padded[sid, within] = xs
        gate, up = torch.bmm(padded, w13.transpose(1, 2)).chunk(2, dim=-1)
        ys = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))[sid, within]
    else:
        ys = torch.empty_like(xs)
        s = 0
        for e, n in enumerate(ch):
            if n:
                gate, up = F.linear(xs[s:s + n], w13[e]).chunk(2, dim=-1)
                ys[s:s + n] = F.linear(F.silu(gate) * up, w2[e])
                s += n
    out = torch.zeros_like(x)
    out.index_add_(0, rows, ys * wts.reshape(-1)[order, None].to(ys.dtype))
    return out


def _measure_experts(dt: torch.dtype):
    """tune's measure(cap) for the routed experts with weights (and rows) of dtype dt against torch's grouped GEMMs:
    16 experts, H 1024, I 256, top-4, by mean rows per expert."""
    def measure(cap: int):
        g = torch.Generator().manual_seed(1)
        w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.03).to(dt)
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.03).to(dt)

        def at(rows):
            T = max(1, rows * EXPERTS // TOPK)
            x = torch.randn(T, HIDDEN, generator=g).to(dt)
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(T)])
            wts = torch.rand(T, TOPK, generator=g)
            return tune.compare(lambda: gemm.experts(x, w13, w2, ids, wts),
                                lambda: grouped_experts(x, w13, w2, ids, wts), trials=3)
        return tune.run_of_wins(tune.EXPERT_ROWS, cap, at)
    return measure


def _builtin_experts(dt: torch.dtype) -> int:
    got = builtin_experts_max_rows(dt, dt)
    return tune.EXPERT_ROWS[-1] if got is None else got


tune.register("linear_f32", lambda: builtin_max_rows(torch.float32), _measure_linear(torch.float32))
tune.register("linear_bf16", lambda: builtin_max_rows(torch.bfloat16), _measure_linear(torch.bfloat16))
tune.register("experts_f32", lambda: _builtin_experts(torch.float32), _measure_experts(torch.float32))
tune.register("experts_bf16", lambda: _builtin_experts(torch.bfloat16), _measure_experts(torch.bfloat16))


def _measure_widen(cap: int):
    """tune's measure for bf16_widen: 256 rows of bfloat16 through a 2048 x 1024 bfloat16 weight, torch's bfloat16
    F.linear against F.linear on float32 copies (the widening counted) -> (1: widen, 0; {"256": widen / bf16})."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 1024, generator=g).to(torch.bfloat16)
    w = torch.randn(2048, 1024, generator=g).to(torch.bfloat16)
    r = tune.compare(lambda: F.linear(x.float(), w.float()).to(torch.bfloat16), lambda: F.linear(x, w), trials=3)
    return int(r <= 1.0), {"256": round(r, 3)}   # a switch, not a limit: the built-in 0 is no cap


tune.register("bf16_widen", lambda: 0, _measure_widen)
