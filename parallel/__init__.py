"""Ranks, groups and token movement for wide expert parallelism.

ParallelConfig (sizes, backends, timeouts) -> bootstrap(cfg) -> ParallelContext, passed to every
module that communicates; make_dispatcher(ctx, ...) moves MoE tokens over the EP group.
"""
from .agreement import check_agreement, fingerprint
from .bootstrap import bootstrap, launch_rank, launch_world_size, shutdown
from .config import ParallelConfig
from .context import ParallelContext
from .dispatch import Dispatched, Dispatcher, DispatchStats, LocalDispatcher, Pending, make_dispatcher
from .watchdog import RankLostError, Watchdog, guard_collective

__all__ = [
    "ParallelConfig", "ParallelContext", "bootstrap", "launch_world_size", "shutdown", "check_agreement", "fingerprint",
    "Dispatched", "Dispatcher", "DispatchStats", "LocalDispatcher", "Pending", "make_dispatcher",
    "RankLostError", "Watchdog", "guard_collective",
]
