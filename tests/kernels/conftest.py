"""Kernel tests run the Triton kernels on CPU tensors under the interpreter when there is no GPU.
TRITON_INTERPRET must be set before `triton.jit` decorates a kernel, i.e. before any kernel module
is imported; the runtime imports them lazily, so setting it here (collection time) is early enough."""
from __future__ import annotations

import os
import sys

import pytest
import torch

KERNEL_MODULES = ("wideep.moe.triton_moe", "wideep.moe.triton_quant", "wideep.attention_mla.triton_decode",
                  "wideep.attention_mla.triton_indexer")

if not torch.cuda.is_available():
    early = [m for m in KERNEL_MODULES if m in sys.modules]
    if early and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{early} were imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
                           f"their kernels would need a GPU")
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def poisoned(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """An output buffer full of NaN: any element a kernel fails to write shows up in the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
