"""A linear layer that keeps an fp8 checkpoint's weight as fp8 (plus its block scales) on the device.

Parameter names match the checkpoint (`weight`, `weight_scale_inv`), so the loader copies the fp8
values and scales untouched. forward: the Triton W8A16 kernel (moe/triton_linear.py) when
`backend == "triton"`; a backend's kernel when one is given (`kernel`: layers/kernels.py fp8_linear, e.g. the
CPU backend's C GEMM that reads the e4m3 bytes as stored); else the torch reference (dequantise, then
F.linear: slow, for checking).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import FP8_DTYPE, dequantize_fp8_block


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None,
                 block: tuple[int, int] = (128, 128), backend: str = "triton", kernel=None):
        """kernel: a backend's fp8_linear (layers/kernels.py); given, it is the forward whatever `backend` says."""
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.dtype = dtype or torch.get_default_dtype()  # activations and output
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(-(-out_features // block[0]), -(-in_features // block[1]),
                                                         device=device, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.backend = "kernel" if kernel is not None else backend
        self.kernel = kernel

    @classmethod
    def factory(cls, block: tuple[int, int], backend: str = "triton", kernel=None):
        """A constructor with nn.Linear's signature, for modules that take `linear=`."""
        def make(in_features, out_features, bias=True, device=None, dtype=None):
            return cls(in_features, out_features, bias, device, dtype, block, backend, kernel)
        return make

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[out, in] in `dtype` (a copy)."""
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype or self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        if x.numel() == 0:   # a zero-token step (an idle EP rank's): no dequantised copy of the weight
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if self.backend == "triton":
            from .triton_linear import fp8_linear
            y = fp8_linear(x.reshape(-1, self.in_features).contiguous(), self.weight, self.weight_scale_inv,
                           self.block).view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.dequantized(x.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={list(self.block)}"
