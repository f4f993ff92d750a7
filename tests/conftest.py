"""Test tiers: `gpu` tests are skipped where no CUDA device is present; multi-rank tests use gloo on
127.0.0.1 only."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# "auto" picks the CPU kernels by the built-in limits, not by measuring this machine (cpu/tune.py): every CPU runs
# the same paths, the C kernels included; tests/cpu/test_tune.py measures.
os.environ.setdefault("WIDEEP_CPU_TUNE", "off")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
