"""Facts about the device a kernel will run on, in one place (attention_mla and moe both ask)."""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_interpreting() -> bool:
    """Triton's interpreter runs kernels on the CPU (TRITON_INTERPRET=1, read when a kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unusable(device: torch.device | str) -> str | None:
    """Why Triton kernels cannot run on `device`, or None when they can. Never imports triton (half a
    second per process): whether it is installed is a lookup."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'wideep[triton]')"
    device = torch.device(device)
    if device.type == "cuda" or triton_interpreting():
        return None
    return (f"the device is {device}; Triton runs on CPU only under TRITON_INTERPRET=1 set before start "
            f"(slow: for tests)")
