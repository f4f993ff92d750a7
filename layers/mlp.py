"""SwiGLU MLP: dense layers and shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None, linear=nn.Linear,
                 limit: float | None = None):
        """linear: nn.Linear or a class with its signature (a backend's, layers/kernels.py; or
        moe.fp8_linear.Fp8Linear.factory). limit: DeepSeek-V4's clamped SwiGLU (gate <= limit, |up| <= limit)."""
        super().__init__()
        self.limit = limit
        self.gate_proj = linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = linear(intermediate, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)
