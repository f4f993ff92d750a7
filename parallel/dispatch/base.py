"""MoE token dispatch/combine: the interface every backend implements, its results and its counters.

Legend: T tokens on this rank, H hidden, k top-k, P physical experts, ep ranks in the EP group,
R rows received by this rank. Physical expert p lives on EP rank p // (P/ep) with local id
p % (P/ep) (parallel.expert_layout.ExpertLayout; EPLB changes which logical expert a slot holds, not this).

    d = dispatcher.dispatch(x[T,H], topk_ids[T,k] (physical, -1 = no expert), topk_weights[T,k], plan)
    y = experts(d.x[R,H], d.topk_ids[R,k] (LOCAL ids, -1 = expert elsewhere), d.topk_weights[R,k])
        # y[R,H]: per received row, the weighted sum over its local slots
    out = dispatcher.combine(y, d.handle)    # [T,H]: sum over ranks = sum over the token's k experts

Every call is collective over the EP group, also when T = 0 on this rank. Each has a start/wait
form (dispatch_start(...).wait()) so a second microbatch can compute while this one is in flight.
`plan` (parallel.step_plan.StepPlan, the same on every rank) picks the mode of this one call; a
dispatcher keeps no per-step state, and the handle tells combine which mode its dispatch used.

Optional capabilities are class attributes, declared here with their "absent" value:
    low_latency_max_tokens  steps planned with at most this many tokens per rank may use the padded
                            low-latency mode (0: the backend has none)
    supports_comm_stream    exchanges can run on a parallel.comm_stream.CommStream thread
    microbatch_groups       DBO gives each microbatch its own copy over its own process group
                            (for_microbatch); False: one instance carries both microbatches
    local_only              every expert is on this rank and nothing moves: an MoE layer may run its
                            experts itself and report the call with account_local(num_tokens)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Callable

from torch import Tensor

from ..context import ParallelContext
from ..expert_layout import ExpertLayout
from ..step_plan import StepPlan
from ..watchdog import guard_collective
from .nodes import NodeLayout
from .routing import NodeHistogram

NORMAL = StepPlan()  # a plan that asks for nothing: normal mode, one call at a time


@dataclass
class Dispatched:
    """What this rank's experts compute on."""
    x: Tensor               # [R, H] received tokens
    topk_ids: Tensor        # [R, k] int64 local expert ids, -1 where that slot's expert is on another rank
    topk_weights: Tensor    # [R, k] fp32, 0 where topk_ids is -1
    handle: Any             # the backend's handle dataclass (handles.py), for combine


@dataclass
class DispatchStats:
    """Counters since the last reset(). Bytes are what is put in send buffers: *_bytes includes the
    rows a rank sends to itself, *_bytes_remote only those for other ranks, = *_bytes_intra (ranks of
    its node) + *_bytes_inter (ranks of other nodes; parallel/dispatch/nodes.py). A two-level
    dispatch counts both of its stages (a row forwarded inside the node counts again)."""
    dispatch_calls: int = 0
    combine_calls: int = 0
    dispatch_bytes: int = 0          # hidden payload
    dispatch_bytes_remote: int = 0
    combine_bytes: int = 0
    combine_bytes_remote: int = 0
    meta_bytes: int = 0              # counts, expert ids, weights
    meta_bytes_inter: int = 0        # the part of meta_bytes sent to ranks of other nodes
    # the *_remote bytes by tier: to other ranks of this rank's node / to ranks of other nodes
    dispatch_bytes_intra: int = 0
    dispatch_bytes_inter: int = 0
    combine_bytes_intra: int = 0
    combine_bytes_inter: int = 0
    low_latency_calls: int = 0       # dispatches in a padded low-latency mode (torch, DeepEP)
    comm_s: float = 0.0              # wall time inside dispatch/combine: the starts and their waits

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# DispatchStats' counters per op, in _count's order (named once: _count runs twice per MoE layer per step)
_COUNTERS = {op: tuple(f"{op}_{f}" for f in ("calls", "bytes", "bytes_remote", "bytes_intra", "bytes_inter"))
             for op in ("dispatch", "combine")}


class Pending:
    """An operation in flight. wait() blocks for its collectives (once) and returns the result;
    with `stats`, the seconds it blocked count in stats.comm_s."""

    def __init__(self, ctx: ParallelContext | None, works: list, finish: Callable[[], Any],
                 stats: DispatchStats | None = None):
        self._ctx, self._works, self._finish, self._stats = ctx, works, finish, stats
        self._done, self._result = False, None

    def wait(self) -> Any:
        if not self._done:
            t0 = time.perf_counter()
            with guard_collective(self._ctx):
                for w in self._works:
                    w.wait()
            self._result, self._done = self._finish(), True
            self._works = self._finish = None
            if self._stats is not None:
                self._stats.comm_s += time.perf_counter() - t0
        return self._result


class Dispatcher:
    """Base: subclasses implement _dispatch_start and _combine_start and report what they send
    through _count; the input checks, the plan's checks and the counters live here."""

    low_latency_max_tokens: int = 0
    supports_comm_stream: bool = False
    microbatch_groups: bool = False
    local_only: bool = False

    def __init__(self, ctx: ParallelContext, num_physical_experts: int, hidden: int):
        self.ctx, self.hidden = ctx, hidden
        self.layout = ExpertLayout(num_physical_experts, ctx.ep_size)
        self.nodes = NodeLayout.of(ctx)
        self.stats = DispatchStats()
        self.routing = NodeHistogram(self.layout, self.nodes)   # nodes touched per token (routing.py)

    @property
    def num_physical_experts(self) -> int:
        return self.layout.num_physical

    @property
    def experts_per_rank(self) -> int:
        return self.layout.per_rank

    # -- the interface ------------------------------------------------------------------------------
    def dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan = NORMAL) -> Pending:
        """x [T,H], topk_ids [T,k] physical (-1 = none), topk_weights [T,k] -> Pending[Dispatched],
        in the mode `plan` asks for (the same plan on every rank)."""
        self._check_inputs(x, topk_ids, topk_weights)
        if plan.low_latency:
            self._check_low_latency(x.shape[0], plan)
        self.routing.add(topk_ids)
        return self._timed(lambda: self._dispatch_start(x, topk_ids, topk_weights, plan))

    def combine_start(self, y: Tensor, handle: Any) -> Pending:
        """y [R,H] (row order of the Dispatched) -> Pending[[T,H]] on the rank the tokens came from,
        in the mode its dispatch used (the handle's type says which)."""
        return self._timed(lambda: self._combine_start(y, handle))

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan = NORMAL) -> Dispatched:
        """Blocking dispatch_start(...).wait()."""
        return self.dispatch_start(x, topk_ids, topk_weights, plan).wait()

    def combine(self, y: Tensor, handle: Any) -> Tensor:
        """Blocking combine_start(...).wait(): y [R,H] weighted per-row sums -> [T,H]."""
        return self.combine_start(y, handle).wait()

    def for_microbatch(self, group, stream) -> "Dispatcher":
        """DBO: a dispatcher of the same kind and limits for one microbatch, over process group
        `group` (and CommStream `stream` when supports_comm_stream). Only with microbatch_groups."""
        raise NotImplementedError(f"{type(self).__name__} carries both microbatches itself (microbatch_groups "
                                  f"is False)")

    # -- for subclasses -----------------------------------------------------------------------------
    def _dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, plan: StepPlan) -> Pending:
        raise NotImplementedError

    def _combine_start(self, y: Tensor, handle: Any) -> Pending:
        raise NotImplementedError

    def _timed(self, start: Callable[[], Pending]) -> Pending:
        """start() -> its Pending, the seconds in start() and later in wait() counted in stats.comm_s."""
        t0 = time.perf_counter()
        pending = start()
        pending._stats = self.stats
        self.stats.comm_s += time.perf_counter() - t0
        return pending

    def _count(self, op: str, nbytes: int = 0, intra_bytes: int = 0, inter_bytes: int = 0, meta_bytes: int = 0,
               low_latency: bool = False, meta_inter_bytes: int = 0) -> None:
        """Record one dispatch or combine (op) that put nbytes of hidden rows in send buffers,
        intra_bytes of them for other ranks of this node and inter_bytes for ranks of other nodes,
        plus meta_bytes of counts/ids/weights, meta_inter_bytes of them for ranks of other nodes
        (what, with inter_bytes, crosses the inter-node wire: launch/cluster compares the two)."""
        names = _COUNTERS.get(op)
        if names is None:
            raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
        st = self.stats
        for name, n in zip(names, (1, nbytes, intra_bytes + inter_bytes, intra_bytes, inter_bytes)):
            setattr(st, name, getattr(st, name) + n)
        if op == "dispatch":
            st.low_latency_calls += low_latency
        st.meta_bytes += meta_bytes
        st.meta_bytes_inter += meta_inter_bytes

    def _check_inputs(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {list(x.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} "
                             f"must both be [T, k] with T = {x.shape[0]}")

    def _check_low_latency(self, num_tokens: int, plan: StepPlan) -> None:
        """Before any collective, so a bad call fails on its own rank instead of hanging the others."""
        if not self.low_latency_max_tokens:
            raise ValueError(f"{type(self).__name__} has no low-latency mode, but the step was planned "
                             f"low-latency; plan with this dispatcher's low_latency_max_tokens (0)")
        if num_tokens > plan.max_tokens:
            raise ValueError(f"low-latency dispatch of {num_tokens} tokens on rank {self.ctx.rank}, but the step "
                             f"was planned for at most {plan.max_tokens} per rank: every rank must dispatch "
                             f"with the StepPlan of this step")
