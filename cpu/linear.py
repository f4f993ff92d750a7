"""nn.Linear whose decode-sized calls run the streaming C kernel (cpu/gemm.py); bigger ones F.linear.

A decode step multiplies each weight by a handful of rows: then reading the weight is the cost, and
the kernel reads it at close to memory speed where BLAS small-M GEMMs reach about a third of it.
Past MAX_ROWS rows the work per weight byte is high enough that BLAS (MKL) is as fast or faster.
bfloat16 weights: the kernel reads them as stored (float32 activations and sums) up to MAX_ROWS rows (16 where
the CPU has AMX tiles: AMX_BF16_MAX_ROWS, max_rows); past it, torch's bfloat16 F.linear (oneDNN's AVX512-BF16 or
AMX GEMM: bench/bf16_gemm.py measures it against ours).
FP8 block-quantised weights (small_linear_fp8, for moe/fp8_linear.py Fp8Linear): the kernel reads the e4m3
bytes as stored up to MAX_ROWS rows; past it, F.linear over a copy dequantised for the call (in x's dtype:
the GEMM's work per weight dwarfs one pass that widens it).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from . import gemm

MAX_ROWS = 64
# bfloat16 weights where the CPU has AMX tiles (amx_bf16): oneDNN's bfloat16 GEMM runs on them and overtakes the C
# kernel's dot products past a handful of rows. Measured (1 thread, this Xeon with AMX): C / oneDNN 0.4-0.6x at 1-4
# rows, ~1.1x at 8, 1.6x at 12, 2.1x at 16, 3.5-5x at 32-64 for one GEMM; in the engine's decode step (the fused
# layer calls against the operations on oneDNN) the crossover lies between 16 and 24 rows: 16 it is.
AMX_BF16_MAX_ROWS = 16


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
    return AMX_BF16_MAX_ROWS if weight_dtype == torch.bfloat16 and amx_bf16() else MAX_ROWS


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] = F.linear(x, weight, bias) in x's dtype, the kernel when x has
    at most max_rows(weight.dtype) rows and x and weight are float32 or bfloat16 CPU tensors (float32 sums, the
    bias added in float32, one rounding to a bfloat16 x's dtype at the end)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if (rows > max_rows(weight.dtype) or rows == 0 or x.dtype not in gemm.WDT or weight.dtype not in gemm.WDT
            or x.device.type != "cpu" or weight.stride(-1) != 1):
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
