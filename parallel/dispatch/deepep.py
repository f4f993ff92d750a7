"""Dispatch/combine through DeepEP's `deep_ep.Buffer` (the V1 API): NVLink/RDMA kernels on GPUs.

Legend as in dispatch.py; El = P / ep local experts, N = low_latency_max_tokens.

- normal mode (prefill): get_dispatch_layout + Buffer.dispatch send each token once per
  destination rank; the received topk_idx already holds local ids with -1 elsewhere and weights 0
  there (our Dispatched contract). Buffer.combine adds the rows back without weights, which is what
  our y (already weighted per row) needs.
- low-latency mode (decode): low_latency_dispatch lays rows out per local expert,
  recv_x [El, N*ep, H] of which recv_count[e] are valid. We present that as R = El*N*ep rows, each
  with one slot (its expert, weight 1; -1 on padding rows); low_latency_combine applies the real
  top-k weights on the way back.

The mode must be the same on every rank (both are collective), so "auto" decides by the step's
largest per-rank token count, which the caller gives to plan() (the engine's DP sync already
all-reduces token counts); without a plan, normal mode.

Not run in CI (needs GPUs with NVLink/RDMA and deep_ep built); written against DeepEP's documented
API. Known gap: with internode normal mode and low-latency mode in one process DeepEP prefers a
single low_latency_mode Buffer plus clean_low_latency_buffer() between modes; this keeps two.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import Dispatched, Dispatcher, Pending


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
        self.mode = "auto"                     # "auto" | "normal" | "low_latency"
        self._step_max_tokens: int | None = None
        self._normal = self._ll = None

    def plan(self, max_tokens_any_rank: int) -> None:
        """Give the largest T of any EP rank for the coming step; "auto" picks the mode from it."""
        self._step_max_tokens = max_tokens_any_rank

    def _mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        m = self._step_max_tokens
        return "low_latency" if m is not None and m <= self.low_latency_max_tokens else "normal"

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
            self._ll = Buffer(self.ctx.ep_group, 0, rdma, low_latency_mode=True, num_qps_per_rank=P // n)
        return self._ll

    def dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Pending:
        self._check_inputs(x, topk_ids, topk_weights)
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the deepep dispatcher carries bfloat16 activations, got {x.dtype}")
        ids, w = topk_ids.long().contiguous(), topk_weights.float().contiguous()
        self.stats.dispatch_calls += 1
        row_bytes = self.hidden * x.element_size()
        if self._mode() == "low_latency":
            return self._ll_dispatch(x, ids, w, row_bytes)
        buf = self._normal_buffer(x)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_physical_experts)
        recv_x, recv_ids, recv_w, _, handle, event = buf.dispatch(
            x, topk_idx=ids, topk_weights=w, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, async_finish=True)
        # SYNC: normal-mode dispatch already made the host wait for the receive counts.
        rows = per_rank.tolist()
        self.stats.dispatch_bytes += sum(rows) * row_bytes
        self.stats.dispatch_bytes_remote += (sum(rows) - rows[self.ctx.ep_rank]) * row_bytes
        d = Dispatched(recv_x, recv_ids, recv_w, handle=("normal", handle))
        return Pending(self.ctx, [_Event(event)], lambda: d)

    def _ll_dispatch(self, x: Tensor, ids: Tensor, w: Tensor, row_bytes: int) -> Pending:
        T, k = ids.shape
        if T > self.low_latency_max_tokens:
            raise ValueError(f"low-latency dispatch of {T} tokens > low_latency_max_tokens "
                             f"({self.low_latency_max_tokens}); plan() the step or raise the limit")
        buf = self._ll_buffer()
        self.stats.low_latency_calls += 1
        recv, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x, ids, self.low_latency_max_tokens, self.num_physical_experts,
            use_fp8=False, async_finish=False, return_recv_hook=True)
        # No sync here (decode must stay CUDA-graph friendly): count every slot as one row sent.
        self.stats.dispatch_bytes += T * k * row_bytes

        def finish() -> Dispatched:
            El, M, H = recv.shape                                                  # [El, N*ep, H]
            valid = torch.arange(M, device=recv.device)[None, :] < recv_count[:, None]   # [El, M]
            expert = torch.arange(El, device=recv.device)[:, None].expand(El, M)
            local = torch.full((El * M, k), -1, dtype=torch.long, device=recv.device)
            local[:, 0] = torch.where(valid, expert, -1).reshape(-1)
            weights = torch.zeros(El * M, k, device=recv.device)
            weights[:, 0] = valid.reshape(-1).float()   # the real weights are applied in combine
            return Dispatched(recv.view(El * M, H), local, weights, handle=("ll", handle, ids, w, (El, M)))

        # async_finish=False: there is no event to wait on, only the receive hook.
        return Pending(self.ctx, [_Event(hook=hook)], finish)

    def combine_start(self, y: Tensor, handle) -> Pending:
        self.stats.combine_calls += 1
        if handle[0] == "normal":
            combined, _, event = self._normal.combine(y, handle[1], async_finish=True)
            self.stats.combine_bytes += y.shape[0] * self.hidden * y.element_size()
            return Pending(self.ctx, [_Event(event)], lambda: combined)
        _, h, ids, w, (El, M) = handle
        combined, _, hook = self._ll.low_latency_combine(
            y.view(El, M, self.hidden), ids, w, h, async_finish=False, return_recv_hook=True)
        return Pending(self.ctx, [_Event(hook=hook)], lambda: combined)
