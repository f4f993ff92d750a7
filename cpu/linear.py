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

from . import gemm

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


def max_rows(weight_dtype: torch.dtype) -> int:
    """The most rows a call with weights of this dtype runs on the C kernel (then BLAS / oneDNN)."""
    if weight_dtype == torch.bfloat16:
        if gemm.amx_on():
            return AMX_TILE_MAX_ROWS
        if amx_bf16():
            return AMX_BF16_MAX_ROWS
    return MAX_ROWS


@functools.lru_cache(maxsize=1)
def _dot_cpu() -> bool:
    """Whether this CPU has AVX512-BF16 (then BLAS's bfloat16 GEMMs run dot products; without, they convert)."""
    return gemm.bf16_dot_supported()


def experts_max_rows(weight_dtype: torch.dtype, x_dtype: torch.dtype) -> int | None:
    """The mean rows per local expert up to which the experts kernel runs a batch (None: every batch)."""
    if weight_dtype == torch.bfloat16 and x_dtype == torch.bfloat16 and _dot_cpu():
        return None if gemm.amx_on() else EXPERTS_MAX_ROWS_BF16
    return EXPERTS_MAX_ROWS


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
    if rows > MAX_ROWS or rows == 0 or x.dtype not in gemm.WDT:
        w = gemm.dequantize_fp8(weight, scale_inv, block, x.dtype if x.dtype in gemm.WDT else torch.float32)
        return F.linear(x, w.to(x.dtype), bias)
    y = gemm.linear_fp8(x.reshape(rows, K), weight, scale_inv, block)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)
