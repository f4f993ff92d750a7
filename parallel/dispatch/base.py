"""MoE token dispatch/combine: the interface, the one-rank case, and the backend choice.

Legend: T tokens on this rank, H hidden, k top-k, P physical experts, ep ranks in the EP group,
R rows received by this rank. Physical expert p lives on EP rank p // (P/ep) with local id
p % (P/ep) (contiguous placement; EPLB changes which logical expert a physical slot holds, not this).

    d = dispatcher.dispatch(x[T,H], topk_ids[T,k] (physical, -1 = no expert), topk_weights[T,k])
    y = experts(d.x[R,H], d.topk_ids[R,k] (LOCAL ids, -1 = expert elsewhere), d.topk_weights[R,k])
        # y[R,H]: per received row, the weighted sum over its local slots
    out = dispatcher.combine(y, d.handle)    # [T,H]: sum over ranks = sum over the token's k experts

Every call is collective over the EP group, also when T = 0 on this rank. Each has a start/wait
form (dispatch_start(...).wait()) so a second microbatch can compute while this one is in flight.
"""
from __future__ import annotations

import time

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch import Tensor

from ..context import ParallelContext
from ..watchdog import guard_collective


@dataclass
class Dispatched:
    """What this rank's experts compute on."""
    x: Tensor               # [R, H] received tokens
    topk_ids: Tensor        # [R, k] int64 local expert ids, -1 where that slot's expert is on another rank
    topk_weights: Tensor    # [R, k] fp32, 0 where topk_ids is -1
    handle: Any             # opaque, for combine


@dataclass
class DispatchStats:
    """Counters since the last reset(). Bytes are what is put in send buffers: *_bytes includes the
    rows a rank sends to itself, *_bytes_remote only those for other ranks."""
    dispatch_calls: int = 0
    combine_calls: int = 0
    dispatch_bytes: int = 0          # hidden payload
    dispatch_bytes_remote: int = 0
    combine_bytes: int = 0
    combine_bytes_remote: int = 0
    meta_bytes: int = 0              # counts, expert ids, weights
    low_latency_calls: int = 0       # dispatches in a padded low-latency mode (torch, DeepEP)
    comm_s: float = 0.0              # wall time inside blocking dispatch()/combine() (start + wait)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Pending:
    """An operation in flight. wait() blocks for its collectives (once) and returns the result."""

    def __init__(self, ctx: ParallelContext | None, works: list, finish: Callable[[], Any]):
        self._ctx, self._works, self._finish = ctx, works, finish
        self._done, self._result = False, None

    def wait(self) -> Any:
        if not self._done:
            with guard_collective(self._ctx):
                for w in self._works:
                    w.wait()
            self._result, self._done = self._finish(), True
            self._works = self._finish = None
        return self._result


class Dispatcher:
    """Base: subclasses implement dispatch_start and combine_start."""

    def __init__(self, ctx: ParallelContext, num_physical_experts: int, hidden: int):
        if num_physical_experts % ctx.ep_size:
            raise ValueError(f"num_physical_experts ({num_physical_experts}) is not divisible by "
                             f"ep_size ({ctx.ep_size})")
        self.ctx, self.hidden = ctx, hidden
        self.num_physical_experts = num_physical_experts
        self.experts_per_rank = num_physical_experts // ctx.ep_size
        self.stats = DispatchStats()

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        """x [T,H], topk_ids [T,k] physical ids, topk_weights [T,k] -> Dispatched (see module doc)."""
        t0 = time.perf_counter()
        out = self.dispatch_start(x, topk_ids, topk_weights).wait()
        self.stats.comm_s += time.perf_counter() - t0
        return out

    def combine(self, y: Tensor, handle: Any) -> Tensor:
        """y [R,H] weighted per-row sums -> [T,H] on the rank the tokens came from."""
        t0 = time.perf_counter()
        out = self.combine_start(y, handle).wait()
        self.stats.comm_s += time.perf_counter() - t0
        return out

    def dispatch_start(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Pending:
        raise NotImplementedError

    def combine_start(self, y: Tensor, handle: Any) -> Pending:
        raise NotImplementedError

    def _check_inputs(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {list(x.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} "
                             f"must both be [T, k] with T = {x.shape[0]}")
