"""SwiGLU MLP: dense layers and shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None, linear=nn.Linear):
        """linear: nn.Linear or a class with its signature (moe.fp8_linear.Fp8Linear.factory)."""
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self._fused_key, self._fused = None, None   # fused()'s kept struct (None: the weights do not fit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused(self):
        """The C kernels' struct for this MLP (cpu/fused.py mlp_layer_weights, DeepseekModel's whole-step
        decode call) when its weights fit them (float32, contiguous, on the CPU, no biases), else None.
        Kept while they are the same memory (looked up in the modules' tables: one replaced is seen)."""
        ps = [self._modules[n]._parameters for n in ("gate_proj", "up_proj", "down_proj")]
        key = (tuple(p["weight"].data_ptr() for p in ps), tuple(p.get("bias") is None for p in ps))
        if key != self._fused_key:
            fit = all(p.get("bias") is None and p["weight"].dtype == torch.float32 and not p["weight"].is_cuda
                      and p["weight"].is_contiguous() for p in ps)
            from cpu.fused import mlp_layer_weights
            self._fused_key, self._fused = key, mlp_layer_weights(self) if fit else None
        return self._fused
