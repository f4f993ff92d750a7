"""The model's shared building blocks (RMSNorm, the SwiGLU MLP) and the per-op kernel table a backend
binds into them at build time (kernels.py). Imported by attention_mla/, moe/ and engine/; imports torch only."""
from .kernels import NATIVE, Kernels
from .mlp import MLP
from .norm import RMSNorm

__all__ = ["Kernels", "NATIVE", "MLP", "RMSNorm"]
