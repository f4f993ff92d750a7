"""A rank started for a resize that grows a running deployment (the launcher set WIDEEP_JOIN: parallel/join.py).

    joined = join(env, model=..., **options)      # the Engine options every rank of the deployment was built with
    engine = Engine(model, joined=joined)         # then engine.run_worker_loop(), as any worker

1. Read the front's ticket from the deployment's store (the new shape's members and epoch, the control channel).
2. Load the model and allocate the KV cache while the running ranks keep serving (EngineCore with wire=False:
   no group exists yet), then say ready: the front sends RESIZE once every new rank is.
3. Form the new shape's groups with the running ranks, receive the plans and this rank's experts from the
   ranks that hold them, and wire with everyone (engine/worker/resize.py settle).
A failure before 3 is published as this rank's "ready" value, so the front fails the resize at once with the
reason, and the running ranks never leave their groups.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Mapping

import torch

from wideep.parallel.join import join_group, join_store, loading_context, mark_ready, read_ticket

from ..engine_config import EngineConfig
from .core import EngineCore
from .resize import settle


@dataclass
class Joined:
    """A joined rank's engine parts, for Engine(joined=...)."""
    core: EngineCore
    channel: str              # the deployment's control channel name
    stats: dict               # its part of the resize, as the running ranks report theirs


def join(env: Mapping[str, str], model: str, progress: bool = False, **options) -> Joined:
    t0 = time.monotonic()
    par = options.get("parallel") or {}
    timeout_s = (par.get("timeout_s") if isinstance(par, dict) else par.timeout_s) or 60.0
    store = join_store(env, timeout_s)
    ticket = read_ticket(store, env)
    try:
        cfg = EngineConfig.from_options(model, world_size=ticket.start_world, **options)
        pcfg = cfg.parallel
        if cfg.eplb.num_redundant_experts or pcfg.num_redundant_experts:   # as connect() lays them out
            pcfg = dataclasses.replace(pcfg, num_redundant_experts=cfg.eplb.redundant_with(pcfg.num_redundant_experts))
        backend = "nccl" if pcfg.backend == "nccl" or (pcfg.backend == "auto" and torch.cuda.is_available()) else "gloo"
        if backend == "nccl":
            raise ValueError("growing a deployment onto CUDA ranks is not supported yet (the launcher assigns no "
                             "device to a new rank); resize CPU (gloo) deployments, or restart with more ranks")
        pre = loading_context(pcfg, store, backend, torch.device("cpu"), env)
        core = EngineCore(cfg, pre, progress=progress, wire=False)
    except Exception as e:   # the front fails the resize with this, at once
        mark_ready(store, ticket, f"rank {ticket.origin} could not load the model: {type(e).__name__}: {e}")
        raise
    mark_ready(store, ticket)
    ctx = join_group(pre, ticket)
    stats = settle(core, ctx, None)
    return Joined(core, ticket.channel, dict(stats, members=list(ticket.members), epoch=ctx.epoch,
                                             regroup_s=ctx.recovery_s, resize_s=time.monotonic() - t0))
