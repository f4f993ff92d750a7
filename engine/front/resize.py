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
