"""Dual-batch overlap at run time: the two microbatches' dispatchers, run through the model's operations.

The model's operation list (engine/model/model.py `step_ops`, the same list a plain step runs) is run for
two microbatches by dbo.schedule.run_overlapped, each on its own OpState with its own dispatcher:

- dispatchers with microbatch_groups (torch, allgather): each microbatch gets a copy over its own
  process group (dispatcher.for_microbatch), the torch one with its own communication thread
  (parallel.comm_stream) — and on CUDA its own stream — so microbatch 0's all-to-all proceeds while
  this thread computes (or launches) microbatch 1, and the order of collectives on each group is
  the same on every rank. Every rank builds the groups in the same order at start-up
  (dist.new_group is collective).
- the others (DeepEP, the one-rank LocalDispatcher) carry both microbatches themselves: their
  state is in the handles (see parallel/dispatch/deepep.py for how DeepEP overlaps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from wideep.parallel.step_plan import StepPlan

from .schedule import run_overlapped
from .split import SplitConfig
from .state import Microbatch, OpState


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
    """Built once per engine, on every rank in the same order (it may create process groups)."""

    def __init__(self, model, ctx):
        import torch.distributed as dist

        from wideep.parallel.comm_stream import CommStream
        self.model = model
        self.streams: list[CommStream] = []
        d = model.dispatcher
        if not d.microbatch_groups:
            self.dispatchers = [d, d]
            return
        self.dispatchers = []
        for _ in range(2):
            group = dist.new_group(backend=ctx.backend)
            stream = CommStream(device=ctx.device) if d.supports_comm_stream else None
            if stream is not None:
                self.streams.append(stream)
            self.dispatchers.append(d.for_microbatch(group, stream))

    def forward(self, micro: list[tuple[torch.Tensor, object]], pools: list[torch.Tensor],
                plan: StepPlan, index_pools: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """micro: two (input_ids [Ti], AttnMeta); plan: the step's (plan.split); index_pools: DSA's
        indexer-key pools or None -> final-normed hidden states [Ti, H] each."""
        states = [OpState(Microbatch(i, ids, meta, pools, plan, d, index_pools=index_pools))
                  for i, ((ids, meta), d) in enumerate(zip(micro, self.dispatchers))]
        return [s.result("hidden") for s in run_overlapped(self.model.step_ops, states)]

    def close(self) -> None:
        for s in self.streams:
            s.close()
