"""One EP rank: every expert is local, physical id = local id, nothing moves.

The single-rank path of the model goes through this dispatcher like any other EP size, so the MoE
layer has one forward. Stateless, so one instance carries both DBO microbatches.
"""
from __future__ import annotations

from torch import Tensor

from ..step_plan import StepPlan
from .base import Dispatched, Dispatcher, Pending
from .handles import LocalHandle


class LocalDispatcher(Dispatcher):
    local_only = True

    def account_local(self, num_tokens: int, layers: int = 1) -> None:
        """A dispatch and its combine of num_tokens routed tokens in each of `layers` MoE layers that
        ran in one call (the CPU decode plan's fused MoE halves and whole-stack call; local_only): the
        counters and routing histogram dispatch_start and combine_start would have recorded."""
        self.routing.add_local(num_tokens * layers)
        st = self.stats   # _count("dispatch") and _count("combine") with nothing sent: two calls, no bytes
        st.dispatch_calls += layers
        st.combine_calls += layers

    def _dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan) -> Pending:
        self._count("dispatch")
        w = topk_weights.float().masked_fill(topk_ids < 0, 0.0)
        d = Dispatched(x, topk_ids.long(), w, LocalHandle(x.shape[0]))
        return Pending(self.ctx, [], lambda: d)

    def _combine_start(self, y: Tensor, handle: LocalHandle) -> Pending:
        if y.shape[0] != handle.num_tokens:
            raise ValueError(f"combine got y with {y.shape[0]} rows, dispatch produced {handle.num_tokens}")
        self._count("combine")
        return Pending(self.ctx, [], lambda: y)
