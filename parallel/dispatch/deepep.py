"""Dispatch/combine through DeepEP's `deep_ep.Buffer` (the V1 API): NVLink/RDMA kernels on GPUs.

Legend as in base.py; El = P / ep local experts, N = low_latency_max_tokens (the LL buffer's tokens
per rank).

- normal mode (prefill): get_dispatch_layout + Buffer.dispatch send each token once per
  destination rank; the received topk_idx already holds local ids with -1 elsewhere and weights 0
  there (our Dispatched contract). Buffer.combine adds the rows back without weights, which is what
  our y (already weighted per row) needs.
- low-latency mode (decode): low_latency_dispatch lays rows out per local expert,
  recv_x [El, N*ep, H] of which recv_count[e] are valid. We present that as R = El*N*ep rows, each
  with one slot (its expert, weight 1; -1 on padding rows); low_latency_combine applies the real
  top-k weights on the way back.

The mode must be the same on every rank (both are collective): each call takes it from its
StepPlan, which the engine's step sync builds from the all-reduced largest per-rank token count
(low-latency when it is <= N). The handle carries the mode to combine.

Both microbatches of a DBO step share one instance (microbatch_groups False): the low-latency
kernels are started with return_recv_hook=True, so dispatch_start/combine_start only issue the
sends and the receive hook runs in wait(), after the other microbatch's compute (DeepEP keeps two
low-latency buffers, enough for two microbatches in flight); normal mode overlaps on DeepEP's own
stream.

Not run in CI (needs GPUs with NVLink/RDMA and deep_ep built); written against DeepEP's documented
API. Known gap: with internode normal mode and low-latency mode in one process DeepEP prefers a
single low_latency_mode Buffer plus clean_low_latency_buffer() between modes; this keeps two.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..step_plan import StepPlan
from .base import Dispatched, Dispatcher, Pending
from .handles import DeepEPHandle, DeepEPLowLatencyHandle


def deepep_unavailable_reason(ctx) -> str | None:
    """None if DeepEP can run in this context, else why not."""
    if ctx.device.type != "cuda" or not torch.cuda.is_available():
        return f"the context's device is {ctx.device}, not a CUDA device"
    try:
        import deep_ep
    except Exception as e:  # ImportError, or a missing NVSHMEM/CUDA symbol when loading its extension
        return f"import deep_ep failed ({type(e).__name__}: {e})"
    if not hasattr(deep_ep, "Buffer"):
        return "this deep_ep has no Buffer class (the V1 API is needed)"
    return None


class _Event:
    """Adapts DeepEP's EventOverlap / receive hook to the .wait() that Pending expects."""

    def __init__(self, event=None, hook=None):
        self.event, self.hook = event, hook

    def wait(self):
        if self.hook is not None:
            self.hook()
        if self.event is not None:
            self.event.current_stream_wait()


class DeepEPDispatcher(Dispatcher):

    def __init__(self, ctx, num_physical_experts: int, hidden: int, low_latency_max_tokens: int = 128):
        super().__init__(ctx, num_physical_experts, hidden)
        self.low_latency_max_tokens = low_latency_max_tokens
        self._normal = self._ll = None

    def _normal_buffer(self, x: Tensor):
        if self._normal is None:
            from deep_ep import Buffer
            n, hidden_bytes = self.ctx.ep_size, self.hidden * max(x.element_size(), 2)
            nvl = rdma = 0
            for cfg in (Buffer.get_dispatch_config(n), Buffer.get_combine_config(n)):
                nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, n))
                rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, n))
            self._normal = Buffer(self.ctx.ep_group, nvl, rdma)
        return self._normal

    def _ll_buffer(self):
        if self._ll is None:
            from deep_ep import Buffer
            n, P = self.ctx.ep_size, self.num_physical_experts
            rdma = Buffer.get_low_latency_rdma_size_hint(self.low_latency_max_tokens, self.hidden, n, P)
            # DeepEP: the QP count must equal the number of local experts for the LL kernels.
            self._ll = Buffer(self.ctx.ep_group, 0, rdma, low_latency_mode=True, num_qps_per_rank=self.experts_per_rank)
        return self._ll

    def _dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan) -> Pending:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the deepep dispatcher carries bfloat16 activations, got {x.dtype}")
        ids, w = topk_ids.long().contiguous(), topk_weights.float().contiguous()
        row_bytes = self.hidden * x.element_size()
        if plan.low_latency:
            return self._ll_dispatch(x, ids, w, row_bytes)
        buf = self._normal_buffer(x)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_physical_experts)
        recv_x, recv_ids, recv_w, _, handle, event = buf.dispatch(
            x, topk_idx=ids, topk_weights=w, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, async_finish=True)
        # SYNC: normal-mode dispatch already made the host wait for the receive counts.
        rows = per_rank.tolist()
        self._count("dispatch", sum(rows) * row_bytes, *self.nodes.tier_bytes(rows, row_bytes))
        d = Dispatched(recv_x, recv_ids, recv_w, DeepEPHandle(handle))
        return Pending(self.ctx, [_Event(event)], lambda: d)

    def _ll_dispatch(self, x: Tensor, ids: Tensor, w: Tensor, row_bytes: int) -> Pending:
        T, k = ids.shape
        if T > self.low_latency_max_tokens:
            raise ValueError(f"low-latency dispatch of {T} tokens > low_latency_max_tokens "
                             f"({self.low_latency_max_tokens}), the size of DeepEP's low-latency buffer")
        buf = self._ll_buffer()
        recv, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x, ids, self.low_latency_max_tokens, self.num_physical_experts,
            use_fp8=False, async_finish=False, return_recv_hook=True)
        # No sync here (decode must stay CUDA-graph friendly): count every slot as one row sent.
        self._count("dispatch", T * k * row_bytes, low_latency=True)

        def finish() -> Dispatched:
            El, M, H = recv.shape                                                  # [El, N*ep, H]
            valid = torch.arange(M, device=recv.device)[None, :] < recv_count[:, None]   # [El, M]
            expert = torch.arange(El, device=recv.device)[:, None].expand(El, M)
            local = torch.full((El * M, k), -1, dtype=torch.long, device=recv.device)
            local[:, 0] = torch.where(valid, expert, -1).reshape(-1)
            weights = torch.zeros(El * M, k, device=recv.device)
            weights[:, 0] = valid.reshape(-1).float()   # the real weights are applied in combine
            return Dispatched(recv.view(El * M, H), local, weights, DeepEPLowLatencyHandle(handle, ids, w, El, M))

        # async_finish=False: there is no event to wait on, only the receive hook.
        return Pending(self.ctx, [_Event(hook=hook)], finish)

    def _combine_start(self, y: Tensor, handle: DeepEPHandle | DeepEPLowLatencyHandle) -> Pending:
        if isinstance(handle, DeepEPHandle):
            combined, _, event = self._normal.combine(y, handle.handle, async_finish=True)
            self._count("combine", y.shape[0] * self.hidden * y.element_size())
            return Pending(self.ctx, [_Event(event)], lambda: combined)
        h = handle
        combined, _, hook = self._ll.low_latency_combine(
            y.view(h.num_local, h.rows_per_expert, self.hidden), h.topk_ids, h.topk_weights, h.handle,
            async_finish=False, return_recv_hook=True)
        self._count("combine")
        return Pending(self.ctx, [_Event(hook=hook)], lambda: combined)
