"""The rank's speculator: which sequences draft this step and how many tokens, what was accepted
(vLLM's metrics), and the turn-down when drafting does not pay. Never touches the device.

Drafting is per sequence: a sequence decodes (one pending token), its request needs no logits
processing other than a grammar (penalties, logit bias, min_p, min_tokens: those rows sample as before;
a grammar's drafts are cut at the first token it does not allow, and each verification row is masked to
the grammar's state after the drafts before it) and it is not backing off.

Backing off: after every two verifications, a sequence whose drafts were accepted at less than
`min_acceptance` pauses for `backoff_steps` steps, doubling (up to 64x) each time it fails again, and at
least for the rank's pause (below); an accepted run resets the pause. With the MTP drafter, a sequence that
fails RETIRE_AFTER times in a row retires: it drafts no more and the drafter stops running its rows. A rank
running more than `disable_by_batch_size` sequences drafts nothing (vLLM's knob).

The rank remembers too: a judgement that fails raises the rank's pause to the failing sequence's, one that
passes halves it, and every judgement moves the rank's average acceptance. While that average is below
`min_acceptance`, a new sequence starts backed off for the rank's pause (with MTP: retired, so the drafter
never runs its prompt), except one in PROBE_EVERY that starts drafting anyway (the rank's probe of whether
drafts pay again), so that a workload whose drafts fail stops paying for every new request's first
verifications. All of it is the rank's own: nothing crosses ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import SpeculativeConfig
from .ngram import NgramIndex

WINDOW = 2        # verifications per acceptance judgement
MAX_PAUSE = 64    # the longest pause, in multiples of backoff_steps
RETIRE_AFTER = 3  # MTP: backoffs in a row after which a sequence stops drafting for good (its MTP rows stop too)
PROBE_EVERY = 8   # while the rank's pause is set, one new sequence in this many starts drafting anyway
RECENT_WEIGHT = 0.25  # the latest judgement's weight in the rank's moving average of acceptance


def can_draft(p) -> bool:
    """Its rows need nothing but (at most) a grammar's mask: the verification rows can be processed exactly."""
    return not p.processed or not (p.penalised or p.logit_bias is not None or p.min_tokens > 0 or p.min_p > 0)


@dataclass(slots=True)
class SeqSpec:
    """One sequence's drafting state."""
    index: NgramIndex | None = None
    drafted: int = 0          # draft tokens in the current window
    accepted: int = 0
    checks: int = 0           # verifications in the current window
    pause: int = 0            # the next pause's length (steps); 0: none yet
    resume_at: int = 0        # the step it may draft again
    failed: int = 0           # backoffs in a row
    retired: bool = False     # MTP: drafts no more, and the drafter no longer keeps its latents
    mtp_drafts: list[int] = field(default_factory=list)   # MTP: the drafter's tokens for the next step
    stash: Any = None         # MTP: first-pass rows deferred while it backs off (engine/spec_decode/drafter.py)


class Speculator:
    def __init__(self, cfg: SpeculativeConfig):
        self.cfg, self.k = cfg, cfg.num_speculative_tokens
        self.step = 0
        self.drafting = True       # this step (disable_by_batch_size)
        # metrics, cumulative (vLLM: spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens[_per_pos])
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.num_backoffs = 0      # times a sequence stopped drafting for low acceptance
        self.paused = 0            # sequences skipped this step because they are backing off
        self.steps_batch_off = 0   # steps without drafts because of disable_by_batch_size
        self.num_retired = 0       # MTP: sequences that stopped drafting for good
        self.rank_pause = 0        # the pause a new sequence starts with (0: it drafts at once)
        self.recent = None         # the acceptance of the rank's recent judgements (a moving average; the first sets it)
        self.num_new = 0           # sequences seen (every PROBE_EVERY-th probes while rank_pause is set)
        self.num_started_paused = 0   # sequences that started backed off because of the rank's pause

    def state(self, s) -> SeqSpec:
        """s's drafting state, made on first use: backed off for the rank's pause when drafts have not paid
        lately (except the rank's probes)."""
        st = s.spec
        if st is None:
            st = s.spec = SeqSpec()
            self.num_new += 1
            if self.rank_pause and self.recent is not None and self.recent < self.cfg.min_acceptance \
                    and self.num_new % PROBE_EVERY:
                st.pause, st.failed = self.rank_pause, 1
                st.resume_at = self.step + self.rank_pause
                # MTP: it would pay the layer's first pass over its prompt for drafts that the rank expects to fail
                st.retired = self.cfg.method == "mtp"
                self.num_started_paused += 1
        return st

    def begin(self, num_running: int) -> None:
        self.step += 1
        self.paused = 0
        b = self.cfg.disable_by_batch_size
        self.drafting = b is None or num_running <= b
        if not self.drafting:
            self.steps_batch_off += 1

    def propose(self, s, room: int) -> list[int]:
        """Drafts for decoding sequence s this step: at most room (and k) tokens."""
        if not self.drafting or room <= 0 or (s.params.processed and not can_draft(s.params)):
            return []
        st = self.state(s)
        if st.resume_at > self.step or st.retired:
            self.paused += 1
            return []
        k = min(self.k, room)
        if self.cfg.method == "ngram":
            if st.index is None:
                st.index = NgramIndex(self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max)
            drafts = st.index.propose(s.token_ids, k)
        else:
            drafts = st.mtp_drafts[:k]
        if drafts and s.params.structured_outputs is not None:
            if s.grammar is None or s.grammar.finish is not None:
                return []
            drafts = drafts[:s.grammar.valid_prefix(drafts)]
        return drafts

    def may_draft_next(self, s) -> bool:
        """Whether s may draft at the next step, as far as this step knows (batch size, backoff, retirement)."""
        st = self.state(s)
        return self.drafting and st.resume_at <= self.step + 1 and not st.retired

    def record(self, s, drafted: int, accepted: int) -> None:
        """After verification: s drafted `drafted` tokens and `accepted` of them were accepted."""
        if not drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        st = s.spec
        st.drafted += drafted
        st.accepted += accepted
        st.checks += 1
        if st.checks < WINDOW:
            return
        rate = st.accepted / st.drafted
        self.recent = rate if self.recent is None else self.recent + RECENT_WEIGHT * (rate - self.recent)
        if st.accepted < self.cfg.min_acceptance * st.drafted:
            # doubling, and at least the rank's pause: a probe that fails waits as long as the rank does
            st.pause = min(max(2 * st.pause if st.pause else self.cfg.backoff_steps, self.rank_pause),
                           MAX_PAUSE * self.cfg.backoff_steps)
            st.resume_at = self.step + st.pause
            st.failed += 1
            self.num_backoffs += 1
            # the MTP layer runs every step for a sequence that may draft again (its latents): one whose drafts
            # keep failing stops costing that
            if self.cfg.method == "mtp" and st.failed >= RETIRE_AFTER:
                st.retired = True
                self.num_retired += 1
            self.rank_pause = max(self.rank_pause, st.pause)
        else:
            st.pause = st.failed = 0
            self.rank_pause //= 2
            if self.rank_pause < self.cfg.backoff_steps:
                self.rank_pause = 0
        st.drafted = st.accepted = st.checks = 0

    def stats(self) -> dict:
        n, d, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_num_drafts": n, "spec_num_draft_tokens": d, "spec_num_accepted_tokens": a,
                "spec_accepted_per_pos": list(self.accepted_per_pos), "spec_backoffs": self.num_backoffs,
                "spec_paused_seqs": self.paused, "spec_steps_batch_off": self.steps_batch_off,
                "spec_retired_seqs": self.num_retired, "spec_rank_pause": self.rank_pause,
                "spec_started_paused": self.num_started_paused, "spec_recent_acceptance": self.recent}
