"""SwiGLU MLP: dense layers and shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None, linear=nn.Linear):
        """linear: nn.Linear or a class with its signature (a backend's, layers/kernels.py; or
        moe.fp8_linear.Fp8Linear.factory)."""
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = linear(intermediate, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
