"""nn.Linear whose decode-sized calls run the streaming C kernel (cpu/gemm.py); bigger ones F.linear.

A decode step multiplies each weight by a handful of rows: then reading the weight is the cost, and
the kernel reads it at close to memory speed where BLAS small-M GEMMs reach about a third of it.
Past MAX_ROWS rows the work per weight byte is high enough that BLAS (MKL) is as fast or faster.
bfloat16 weights: the kernel reads them as stored (float32 activations and sums) up to MAX_ROWS rows; past
it, torch's bfloat16 F.linear (oneDNN's AVX512-BF16 GEMM: bench/bf16_gemm.py measures it against ours).
FP8 block-quantised weights (small_linear_fp8, for moe/fp8_linear.py Fp8Linear): the kernel reads the e4m3
bytes as stored up to MAX_ROWS rows; past it, F.linear over a copy dequantised for the call (in x's dtype:
the GEMM's work per weight dwarfs one pass that widens it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import gemm

MAX_ROWS = 64


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] = F.linear(x, weight, bias) in x's dtype, the kernel when x has
    at most MAX_ROWS rows and x and weight are float32 or bfloat16 CPU tensors (float32 sums, the bias added
    in float32, one rounding to a bfloat16 x's dtype at the end)."""
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if (rows > MAX_ROWS or rows == 0 or x.dtype not in gemm.WDT or weight.dtype not in gemm.WDT
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
