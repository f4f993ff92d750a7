"""Ranks, groups and token movement for wide expert parallelism.

ParallelConfig (sizes, backends, timeouts) -> bootstrap(cfg) -> ParallelContext, passed to every
module that communicates; ExpertLayout says which EP rank holds each physical expert slot;
make_dispatcher(ctx, ...) moves MoE tokens over the EP group, one call at a time in the mode its
StepPlan (the step's agreed plan) asks for.
"""
from .agreement import check_agreement, fingerprint
from .bootstrap import bootstrap, launch_rank, launch_world_size, shutdown, under_launcher
from .config import ParallelConfig
from .context import ParallelContext
from .dispatch import Dispatched, Dispatcher, DispatchStats, LocalDispatcher, Pending, make_dispatcher
from .expert_layout import ExpertLayout
from .step_plan import StepPlan
from .watchdog import RankLostError, Watchdog, guard_collective

__all__ = [
    "ParallelConfig", "ParallelContext", "bootstrap", "launch_world_size", "shutdown", "under_launcher", "check_agreement", "fingerprint",
    "Dispatched", "Dispatcher", "DispatchStats", "LocalDispatcher", "Pending", "make_dispatcher",
    "ExpertLayout", "StepPlan", "RankLostError", "Watchdog", "guard_collective",
]
