"""Dual-batch overlap at run time: two microbatch dispatchers and the model's operation list.

Torch backend (gloo or NCCL): each microbatch gets its own torch dispatcher over its own process
group with its own communication thread (parallel.comm_stream) — and on CUDA its own stream — so
microbatch 0's all-to-all proceeds while this thread computes (or launches) microbatch 1, and the
order of collectives on each group is the same on every rank. Every rank builds the groups in the
same order at start-up (dist.new_group is collective).

DeepEP backend: both microbatches share the model's DeepEP dispatcher. Its low-latency kernels are
started with return_recv_hook=True, so dispatch_start/combine_start only issue the sends and the
receive hook runs in wait(), after the other microbatch's compute (DeepEP keeps two low-latency
buffers, enough for two microbatches in flight); normal mode overlaps on DeepEP's own stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model_ops import build_ops
from .schedule import run_overlapped
from .split import SplitConfig


@dataclass(frozen=True)
class DboConfig:
    enabled: bool | str = False            # False | True | "auto" (split when it measured faster)
    decode_token_threshold: int = 2
    prefill_token_threshold: int = 2

    def __post_init__(self):
        if self.enabled not in (False, True, "auto"):
            raise ValueError(f"dbo.enabled must be true, false or \"auto\", got {self.enabled!r}")
        SplitConfig(self.decode_token_threshold, self.prefill_token_threshold)

    @property
    def split(self) -> SplitConfig:
        return SplitConfig(self.decode_token_threshold, self.prefill_token_threshold)

    @classmethod
    def coerce(cls, v) -> "DboConfig":
        if isinstance(v, cls):
            return v
        if v is None or isinstance(v, (bool, str)):
            return cls(enabled=v or False)
        return cls(**v)


class Overlap:
    def __init__(self, model, ctx, link=None):
        import torch.distributed as dist

        from parallel.comm_stream import CommStream
        from parallel.dispatch import make_dispatcher
        from parallel.dispatch.deepep import DeepEPDispatcher
        self.model = model
        self.streams = []
        self.dispatchers = []
        self.ops = build_ops(model)
        if isinstance(model.dispatcher, DeepEPDispatcher):
            self.dispatchers = [model.dispatcher, model.dispatcher]
            return
        num_physical = model.shard.num_physical if model.shard is not None else model.cfg.moe.n_routed_experts
        for _ in range(2):
            group = dist.new_group(backend=ctx.backend) if not ctx.is_single else None
            stream = CommStream(device=ctx.device)
            self.streams.append(stream)
            self.dispatchers.append(make_dispatcher(
                ctx, num_physical, model.cfg.hidden_size, "torch", group=group, stream=stream, link=link,
                torch_low_latency_max_tokens=getattr(model.dispatcher, "low_latency_max_tokens", 0)))

    def forward(self, micro: list[tuple[torch.Tensor, object]], pools: list[torch.Tensor]) -> list[torch.Tensor]:
        """micro: two (input_ids [Ti], AttnMeta) -> final-normed hidden states [Ti, H] each."""
        states = [{"ids": ids, "meta": meta, "pools": pools, "dispatcher": d}
                  for (ids, meta), d in zip(micro, self.dispatchers)]
        return [s["x"] for s in run_overlapped(self.ops, states)]

    def close(self) -> None:
        for s in self.streams:
            s.close()
