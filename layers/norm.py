"""RMSNorm as DeepSeek uses it (statistics in fp32, weight applied in the input dtype)."""
from __future__ import annotations

import torch
from torch import nn

from .kernels import NATIVE, Kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None, kernels: Kernels = NATIVE):
        """kernels: the backend's table (layers/kernels.py); its rmsnorm, when it has one, is the forward."""
        super().__init__()
        self.eps = eps
        self.kernel = kernels.rmsnorm
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
