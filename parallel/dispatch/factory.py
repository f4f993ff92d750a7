"""make_dispatcher: the backend choice, made once when the model is built."""
from __future__ import annotations

import torch

from ..config import DISPATCH_BACKENDS
from ..context import ParallelContext
from .base import Dispatcher
from .local import LocalDispatcher


def make_dispatcher(ctx: ParallelContext, num_physical_experts: int, hidden: int, backend: str = "auto", *,
                    dtype: torch.dtype | None = None, low_latency_max_tokens: int = 128,
                    torch_low_latency_max_tokens: int = 0, link=None, group=None, stream=None) -> Dispatcher:
    """Pick the dispatcher for this context.

    backend: "auto" (deepep when it imports, CUDA is up and dtype is bf16; else hierarchical when the
    EP group spans more than one node; else torch), "torch" (flat: once per destination rank),
    "hierarchical" (two-level: once per destination node, then inside the node), "allgather" (the
    reference), "deepep" (error if unusable). One EP rank always gets
    LocalDispatcher, whatever the backend (serving on one rank goes through it too). dtype: the activations' dtype (DeepEP carries bf16 only). low_latency_max_tokens:
    DeepEP's; torch_low_latency_max_tokens: steps planned with at most this many tokens per rank use
    the torch dispatchers' padded fixed-size mode (0: never; see torch_normal.py). link, stream:
    torch and hierarchical backends only (simulated network or link, communication thread; see
    comm_stream.py); group: the process group of the torch, hierarchical and allgather backends
    (default ctx.ep_group).
    """
    from .deepep import deepep_unavailable_reason

    if backend not in DISPATCH_BACKENDS:
        raise ValueError(f"dispatch backend must be {'|'.join(DISPATCH_BACKENDS)}, got {backend!r}")
    if ctx.is_single or ctx.ep_size == 1:  # nothing moves, whichever backend was asked for
        return LocalDispatcher(ctx, num_physical_experts, hidden)
    if backend == "deepep":
        reason = deepep_unavailable_reason(ctx)
        if reason:
            raise RuntimeError(f"dispatch backend 'deepep' needs the deep_ep package and CUDA: {reason}")
    if backend == "auto":
        usable = deepep_unavailable_reason(ctx) is None and dtype == torch.bfloat16
        backend = "deepep" if usable else "hierarchical" if ctx.num_nodes > 1 else "torch"
    if backend == "deepep":
        from .deepep import DeepEPDispatcher
        return DeepEPDispatcher(ctx, num_physical_experts, hidden, low_latency_max_tokens=low_latency_max_tokens)
    if backend == "allgather":
        from .allgather import AllGatherDispatcher
        return AllGatherDispatcher(ctx, num_physical_experts, hidden, group=group)
    if backend == "hierarchical":
        from .hierarchical import HierarchicalDispatcher
        return HierarchicalDispatcher(ctx, num_physical_experts, hidden, group=group, stream=stream, link=link,
                                      low_latency_max_tokens=torch_low_latency_max_tokens)
    from .torch_normal import TorchDispatcher
    return TorchDispatcher(ctx, num_physical_experts, hidden, group=group, stream=stream, link=link,
                           low_latency_max_tokens=torch_low_latency_max_tokens)
