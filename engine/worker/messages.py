"""What the front and the ranks tell each other, asynchronously (engine/worker/channel.py carries it).

front -> a rank's inbox:   NewRequest, Abort, Wake, Command
a rank -> the front:       Report (the step's Deltas, the rank's stats, wave notices, KV events)

None of this is on the lockstep path: the only per-step collective among ranks is the step sync's
fixed-size all-reduce (engine/worker/step_sync.py). Waves (see engine/worker/rank_loop.py): ranks
that all went idle block on their inboxes; the front wakes a domain (the ranks in lockstep) with
Wake(n) when it has work for it again, and tags every request with the wave it believes is running.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams

END, SHUTDOWN, RESIZE = 1, 2, 3   # Command kinds, also the step sync's command flag (seq * 4 + kind)


@dataclass
class NewRequest:
    request_id: str
    ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: float              # time.time() at the front
    wave: int = 0               # the wave the front believed was running when it sent this
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. disaggregation's transfer id


@dataclass
class Abort:
    request_id: str


@dataclass
class Wake:
    wave: int


@dataclass
class Command:
    kind: int                   # END (leave the worker loop) | SHUTDOWN | RESIZE
    seq: int                    # the front's count of commands: a rank obeys each number once
    members: tuple[int, ...] | None = None   # RESIZE: the ranks of the new shape (origin ranks, in order)
    tag: str = ""               # RESIZE: names this resize's rendezvous (a grow's new ranks know it too)


@dataclass(slots=True)
class Delta:
    """What one request did in one step (or since the rank last reported it)."""
    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float
    finish_reason: str | None = None
    prompt_logprobs: list | None = None       # sent once, with the first token
    queue_s: float | None = None              # on the rank: received -> first scheduled (first delta)
    num_preemptions: int = 0
    num_cached_tokens: int | None = None      # prefix-cache hit tokens at admission (first delta)
    metrics: dict | None = None               # extra per-request figures (disaggregation)
    generator_state: bytes | None = None      # seeded sampling: the generator after these tokens, so
    #                                           the request can resume on another rank after a loss


@dataclass
class Report:
    rank: int                                 # global rank
    deltas: list[Delta] = field(default_factory=list)
    stats: dict | None = None                 # the rank's scheduler/cache/dispatch stats, when sent
    generated: int = 0                        # tokens produced in the steps this report covers
    idle_wave: int | None = None              # the domain went idle; its next wave is this
    start_wave: int | None = None             # a request came for a finished wave: start this one
    error: str | None = None                  # the rank's loop failed (the text of the exception)
    recovered: dict | None = None             # the ranks re-formed after a loss (engine/worker/recovery.py)
    resized: dict | None = None               # the ranks re-formed on request (engine/worker/resize.py)
    left: bool = False                        # a resize dropped this rank: its last report (its requests move)
    kv_events: Any = None                     # kvstore.KVEvents: blocks it started / stopped holding
