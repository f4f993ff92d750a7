"""GPU tiers (skipped without CUDA): NCCL torch dispatcher and DeepEP agree with the allgather
reference on 2 ranks."""
from __future__ import annotations

import pytest
import torch

from tests.parallel.spawn import spawn


def _compare(backend: str) -> float:
    from wideep.parallel import ParallelConfig, bootstrap, make_dispatcher, shutdown
    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2, backend="nccl"))
    g = torch.Generator(device="cpu").manual_seed(ctx.rank)
    T, H, k, P = 33, 256, 4, 16
    x = torch.randn(T, H, generator=g).to(ctx.device, torch.bfloat16)
    ids = torch.stack([torch.randperm(P, generator=g)[:k] for _ in range(T)]).to(ctx.device)
    w = torch.rand(T, k, generator=g).to(ctx.device)
    outs = {}
    for name in (backend, "allgather"):
        d = make_dispatcher(ctx, P, H, name, dtype=torch.bfloat16)
        got = d.dispatch(x, ids, w)
        # fake experts: local expert e scales its rows by (e + 1), weighted by the slot weights
        scale = ((got.topk_ids + 1).clamp(min=0).float() * got.topk_weights).sum(-1, keepdim=True)
        outs[name] = d.combine((got.x.float() * scale).to(x.dtype), got.handle).float()
    err = (outs[backend] - outs["allgather"]).abs().max().item()
    shutdown(ctx)
    return err


@pytest.mark.gpu
@pytest.mark.multirank
def test_nccl_torch_dispatcher_matches_allgather():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert max(spawn(_compare, 2, args=("torch",), timeout_s=300)) < 5e-2


@pytest.mark.gpu
@pytest.mark.multirank
def test_deepep_matches_allgather():
    pytest.importorskip("deep_ep")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert max(spawn(_compare, 2, args=("deepep",), timeout_s=300)) < 5e-2
