"""The front's side of a resize on request: vLLM's `POST /scale_elastic_ep {"new_data_parallel_size": N}`,
Engine.start_resize(N), AsyncEngine.scale_elastic_ep(N).

    front.await_joiners(...)      a grow: the launcher started the new ranks; they load the model while the
                                  others serve, then say ready (parallel/join.py); then, as for a shrink:
    front.start_resize(members)   the RESIZE command to every rank; the leaving ranks take no new request
    (reports)                     a leaving rank's last report (Report.left): its requests move to the ranks that
                                  stay, from their prompt and the tokens so far (recompute); each member's
                                  Report.resized: it serves in the new shape
    front.resizing.done           -> front.finish_resize() -> the figures the route answers with

Requests keep being accepted throughout: they go to the staying ranks' inboxes and are taken up as soon as the
new shape steps. None is lost: a leaving rank's requests are re-admitted only once its last report is in, so
the tokens it made are kept and none is computed twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from wideep.parallel.join import readiness

from ..worker.messages import RESIZE, Command


class ResizeError(ValueError):
    """A resize that cannot be done as asked (answered 400; nothing changed)."""


class ResizeConflict(RuntimeError):
    """A resize while another one is running (answered 409; nothing changed)."""


class ResizeFailed(RuntimeError):
    """A grow whose new ranks could not join (answered 503; the deployment serves on unchanged)."""


JOIN_TIMEOUT_S = 300.0   # a grow's new ranks load the model meanwhile: the longest the front waits for them


@dataclass
class Joining:
    """A grow before its RESIZE: the new ranks (origin ranks) load the model; ticket: parallel/join.py's."""
    ticket: object
    joiners: list[int]
    deadline: float


@dataclass
class Resizing:
    """One resize as the front follows it; members are origin ranks."""
    old: list[int]
    new: list[int]
    started: float = field(default_factory=time.monotonic)
    resized: set[int] = field(default_factory=set)     # members that report serving in the new shape
    left: set[int] = field(default_factory=set)        # leaving ranks whose last report came
    moved: int = 0                                     # requests re-admitted on the ranks that stay
    figures: dict = field(default_factory=dict)        # the members' reports, summed / maxed
    error: str = ""                                    # a grow that failed before RESIZE went out

    @property
    def leaving(self) -> list[int]:
        return [r for r in self.old if r not in self.new]

    @property
    def done(self) -> bool:
        return self.resized >= set(self.new) and self.left >= set(self.leaving)

    def add(self, rank: int, rep: dict) -> None:
        self.resized.add(rank)
        for key in ("expert_bytes_peer", "expert_bytes_checkpoint"):
            self.figures[key] = self.figures.get(key, 0) + rep.get(key, 0)
        for key in ("regroup_s", "resize_s"):
            self.figures[f"rank_{key}_max"] = max(self.figures.get(f"rank_{key}_max", 0.0), rep.get(key, 0.0))
        for key in ("epoch", "num_physical", "slots_per_rank"):
            if key in rep:
                self.figures[key] = rep[key]

    def result(self) -> dict:
        return {"old_data_parallel_size": len(self.old), "new_data_parallel_size": len(self.new),
                "members": list(self.new), "left": self.leaving, "resize_s": round(time.monotonic() - self.started, 3),
                "requests_moved": self.moved, **self.figures}


class ResizingFront:
    """The front's resize steps (engine/front/front.py Front has them): what it sends, and what it does with the
    ranks' resize reports."""

    def start_resize(self, members: list[int], tag: str = "") -> None:
        """RESIZE to every rank (one domain: colocated serving); from now on the leaving ranks take no new request."""
        d = self.domains[0]
        self.commands += 1
        tag = tag or f"shrink-{self.commands}"
        self.channel.broadcast(d.ranks, Command(RESIZE, self.commands, tuple(members), tag))
        d.running = True
        self.resizing = Resizing(list(d.ranks), list(members))
        d.ranks = [r for r in d.ranks if r in members]

    def await_joiners(self, ticket, joiners: list[int], deadline: float) -> None:
        """A grow: the launcher started `joiners`; RESIZE goes out once every one of them loaded the model."""
        self.next_origin += len(joiners)
        self.joining = Joining(ticket, joiners, deadline)
        self.resizing = Resizing(list(self.domains[0].ranks), list(ticket.members))

    def check_joiners(self) -> None:
        """While a grow waits: every new rank ready -> RESIZE to the running ranks; one that failed, or the
        deadline -> the resize fails (nothing changed: the running ranks never left their groups)."""
        j = self.joining
        ready, error = readiness(self.channel.store, j.ticket, j.joiners)
        if error or (not ready and time.monotonic() > j.deadline):
            self.joining = None
            self.resizing.error = error or f"the new ranks {j.joiners} did not load the model in time"
        elif ready:
            self.joining = None
            started = self.resizing.started
            self.start_resize(list(j.ticket.members), j.ticket.name)
            self.resizing.started = started
            self.resizing.figures["new_ranks_ready_s"] = round(time.monotonic() - started, 3)   # their load

    def finish_resize(self) -> dict | None:
        """-> the figures of the resize once the new shape serves (then it is over), else None. Raises
        ResizeFailed (then it is over too) when it could not be done."""
        if self.resizing is None:
            return None
        if self.resizing.error:
            error, self.resizing = self.resizing.error, None
            raise ResizeFailed(f"{error}; the deployment serves on unchanged")
        if not self.resizing.done:
            return None
        result, self.resizing = self.resizing.result(), None
        self.resizes.append(result)
        return result

    def _joined(self, rank: int) -> None:
        """A new rank serves in the new shape: requests may go to it."""
        d = self.domains[0]
        self.channel.add([rank])
        d.ranks.append(rank)
        d.ranks.sort(key=self.resizing.new.index)   # the new shape's order: its EP ranks, and the next resize's
        d.load[rank] = 0
        self.domain_of[rank] = d

    def _left(self, rank: int) -> None:
        """A leaving rank's last report is in: its requests go to the ranks that stay, from the tokens so far."""
        for st in list(self.requests.values()):
            if st.dp_rank == rank:
                self._readmit(st)
                self.resizing.moved += 1
        self.domains[0].load.pop(rank, None)
        self.domain_of.pop(rank, None)
        self.rank_stats.pop(rank, None)
        if self.router is not None:
            self.router.forget_rank(rank)
        self.channel.drop(rank)
        self.resizing.left.add(rank)


def plan_members(current: list[int], new_size: int) -> list[int]:
    """The ranks of the new shape: a shrink keeps the first new_size (rank 0, the front, always stays)."""
    return list(current[:new_size])


def check_size(value, current: int, running: bool, refusal: str | None, most: int, grow_refusal: str | None) -> int:
    """new_data_parallel_size as asked -> the size; raises ResizeError / ResizeConflict naming the problem.
    refusal: why this deployment cannot resize at all (None: it can); most: the most ranks it may grow to;
    grow_refusal: why it cannot start ranks (None: it can)."""
    if refusal is not None:
        raise ResizeError(refusal)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ResizeError(f"new_data_parallel_size must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ResizeError(f"new_data_parallel_size must be >= 1, got {value}")
    if running:
        raise ResizeConflict("a resize is already running; ask again once it has answered "
                             "(GET /is_scaling_elastic_ep says when)")
    if value > current:
        if grow_refusal is not None:
            raise ResizeError(f"cannot grow from {current} to {value} ranks: {grow_refusal}")
        if value > most:
            raise ResizeError(f"new_data_parallel_size ({value}) is more ranks than this deployment can run: "
                              f"at most {most}")
    return value
