"""One EP rank: every expert is local, physical id = local id, nothing moves."""
from __future__ import annotations

from .base import Dispatched, Dispatcher, Pending


class LocalDispatcher(Dispatcher):
    """One EP rank: every expert is local, physical id = local id, nothing moves."""

    def dispatch_start(self, x, topk_ids, topk_weights) -> Pending:
        self._check_inputs(x, topk_ids, topk_weights)
        self.stats.dispatch_calls += 1
        w = topk_weights.float().masked_fill(topk_ids < 0, 0.0)
        d = Dispatched(x, topk_ids.long(), w, handle=x.shape[0])
        return Pending(self.ctx, [], lambda: d)

    def combine_start(self, y, handle) -> Pending:
        if y.shape[0] != handle:
            raise ValueError(f"combine got y with {y.shape[0]} rows, dispatch produced {handle}")
        self.stats.combine_calls += 1
        return Pending(self.ctx, [], lambda: y)
