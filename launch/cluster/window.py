"""The bytes each host's wire carried during one block of SPMD code (`wideep run`'s generation).

    with WireWindow(llm.ctx, wire_device()) as w:     # collective: every rank enters and leaves
        outs = llm.generate(...)
    w.per_node()                                      # collective: [LinkBytes of node 0, node 1, ...]

Local rank 0 of each node reads its device's counters; a barrier after the first reading and one
before the second keep every rank's traffic of the block inside the window, whichever rank starts
or finishes first. The two barriers' own bytes (a few hundred) fall inside too.
"""
from __future__ import annotations

import torch.distributed as dist

from wideep.engine.worker.step_sync import gather_outputs
from wideep.parallel.watchdog import guard_collective

from .wire import LinkBytes


class WireWindow:
    def __init__(self, ctx, dev: str | None):
        self.ctx, self.dev = ctx, dev
        self.reads = ctx.local_rank == 0 and dev is not None
        self._before: LinkBytes | None = None
        self.bytes: LinkBytes | None = None     # this node's, on its local rank 0

    def _barrier(self) -> None:
        # dev is None on every rank or on none (the same launch environment): no window, no collective
        if self.dev is not None and not self.ctx.is_single:
            with guard_collective(self.ctx):
                dist.barrier(group=self.ctx.cpu_group)

    def __enter__(self) -> "WireWindow":
        if self.reads:
            self._before = LinkBytes.of_dev(self.dev)
        self._barrier()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            return
        self._barrier()
        if self.reads:
            self.bytes = LinkBytes.of_dev(self.dev) - self._before

    def per_node(self) -> list[LinkBytes]:
        """Collective: every node's bytes, in node order ([] without a device)."""
        b = self.bytes
        mine = (b.sent, b.received, b.sent_frames, b.received_frames) if b is not None else None
        got = gather_outputs(self.ctx, {self.ctx.rank: mine}, self.ctx.world_size)
        return [LinkBytes(*b) for b in got if b is not None]
