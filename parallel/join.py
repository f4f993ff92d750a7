"""A rank that joins a running deployment: a resize on request that grows it (engine/front/resize.py asks the
launcher for the new ranks; engine/worker/join.py drives one).

    store = join_store(env, timeout_s)                    # the deployment's rendezvous store (MASTER_ADDR/PORT)
    ticket = read_ticket(store, env)                      # what the front published for this resize
    pre = loading_context(cfg, store, ...)                # to load the model before any group exists
    mark_ready(store, ticket)                             # the front sends RESIZE once every new rank is ready
    ctx = join_group(pre, ticket)                         # with every rank of the new shape, under its epoch

The new ranks form the new groups together with the running ones (gloo groups cannot take new members, so the
whole new shape forms fresh: parallel/reform.py regroup on the running ranks, this on the new ones), over the
same store under the next epoch's prefix; the new ranks' origin ranks were never used before, so no key of
an earlier rank is read.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from .bootstrap import watch_settings
from .config import ParallelConfig
from .context import ParallelContext
from .reform import _connect, resize_store

JOIN_ENV = "WIDEEP_JOIN"           # set by the launcher on a rank it starts for a resize: the ticket's name
TICKETS = "wideep/join/"


@dataclass(frozen=True)
class Ticket:
    """What a joining rank needs of the running deployment (published by the front, JSON in the store)."""
    name: str
    members: tuple[int, ...]   # origin ranks of the new shape, in order
    epoch: int                 # the new shape's epoch
    channel: str               # the engine's control channel (engine/worker/channel.py)
    start_world: int           # the deployment's size at start-up (its config's layout, which loading follows)
    origin: int = -1           # this rank's origin rank (on a joining rank)

    def publish(self, store) -> None:
        store.set(TICKETS + self.name, json.dumps({"members": list(self.members), "epoch": self.epoch,
                                                   "channel": self.channel, "start_world": self.start_world}))

    def ready_keys(self, joiners: list[int]) -> list[str]:
        return [f"{TICKETS}{self.name}/ready/{r}" for r in joiners]


def join_store(env: Mapping[str, str], timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def read_ticket(store, env: Mapping[str, str]) -> Ticket:
    name = env[JOIN_ENV]
    d = json.loads(store.get(TICKETS + name))
    return Ticket(name, tuple(d["members"]), d["epoch"], d["channel"], d["start_world"], int(env["RANK"]))


def loading_context(cfg: ParallelConfig, store, backend: str, device: torch.device,
                    env: Mapping[str, str]) -> ParallelContext:
    """A context to load the model with before the new groups exist: one process (no collective can run) laid
    out as EP rank 0 of the start-up layout, so that the model builds with one rank's share of expert slots
    (the resize then fills them with this rank's placement); it carries the store and the watchdog settings."""
    return ParallelContext(device=device, backend=backend, ep_size=cfg.ep_size, store=store, timeout_s=cfg.timeout_s,
                           launcher="torchrun", on_rank_loss=cfg.on_rank_loss,
                           watch_settings=watch_settings(cfg, 0, env["MASTER_ADDR"], int(env["MASTER_PORT"]), False))


def mark_ready(store, ticket: Ticket, error: str = "") -> None:
    """"ok", or why this rank cannot join (the front then fails the resize with it)."""
    store.set(ticket.ready_keys([ticket.origin])[0], error or "ok")


def readiness(store, ticket: Ticket, joiners: list[int]) -> tuple[bool, str]:
    """The front: (every new rank answered, the first failure's reason or "")."""
    answered = [k for k in ticket.ready_keys(joiners) if store.check([k])]
    errors = [v.decode() for v in store.multi_get(answered) if v != b"ok"] if answered else []
    return len(answered) == len(joiners) or bool(errors), errors[0] if errors else ""


def join_group(pre: ParallelContext, ticket: Ticket) -> ParallelContext:
    """Form the new shape's groups with the running ranks (they come once the front sends RESIZE)."""
    t0 = time.monotonic()
    ctx = _connect(pre, resize_store(pre.store, ticket.epoch, ticket.name), list(ticket.members), ticket.epoch,
                   origin=ticket.origin)
    ctx.recovery_s = time.monotonic() - t0
    return ctx
