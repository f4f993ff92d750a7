"""RMSNorm as DeepSeek uses it (statistics in fp32, weight applied in the input dtype). With `kernel`,
float32 CPU inputs go through the C kernel (cpu/layers.py rmsnorm: one call instead of six ops)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None, kernel: bool = False):
        super().__init__()
        self.eps, self.kernel = eps, kernel
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.dtype == torch.float32 and x.device.type == "cpu":
            from cpu.layers import rmsnorm
            return rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
