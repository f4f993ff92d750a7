"""Per-DP-rank scheduler: continuous batching with chunked prefill and preemption. Never touches the device.

Each step: every running sequence that decodes gets one token, sequences (re)filling their prompt
get chunks, then waiting sequences are admitted FCFS while the token budget
(max_num_batched_tokens), the running cap (max_num_seqs) and free blocks allow. When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed from its prompt and the tokens
it has already produced — nothing is lost and its output is unchanged.

A sequence whose prefix continues in the disk tier (kvstore/) steps aside while those blocks are
read (`loading`), letting the sequences behind it run, and rejoins the front of the queue when they
are in host memory; with nothing else to run, the step waits for the reads instead.

A sequence's lifecycle lives here: add (waiting) -> schedule (running, blocks grown) -> apply the
runner's StepResult (tokens computed, sampled token appended, full blocks hashed for the prefix
cache, finished sequences freed) -> finish. adopt/release let other parts hand sequences in and
out with their KV (disaggregation: a decode rank adopts a sequence whose KV arrived; a prefill rank
releases one whose KV is still being sent).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import repeat

from .block_manager import BlockManager
from .sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed this step per sequence


@dataclass
class StepResult:
    """What the runner computed for a ScheduledBatch (B sequences); it changes no sequence itself."""
    tokens: list[int | None]                 # [B] sampled token; None: the sequence has not caught up
    logprobs: list[float | None]             # [B] the sampled token's logprob
    top: list[dict[int, float] | None]       # [B] top-N logprobs, for sequences that asked
    prompt_logprobs: list[list | None]       # [B] prompt-logprob entries for positions not recorded yet
    #                                          (None: the sequence did not ask for them)
    accepted: list[Accepted | None] | None = None   # [B] speculative steps: the drafts accepted before `tokens`


@dataclass(slots=True)
class Accepted:
    """A sequence's accepted drafts this step, in order, each with its logprob (and top-N when asked)."""
    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float] | None]


READ_TIMEOUT_S = 30.0   # the longest a step waits for disk reads when it has nothing else to run


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, speculator=None,
                 lookahead: int = 0, mixed_step_tokens: int | None = None):
        """speculator: engine/spec_decode/speculator.Speculator when drafting is on; lookahead: slots grown past a
        step's tokens (MTP drafting: k - 1, where its later passes write). mixed_step_tokens (None: off): while
        fewer sequences decode, a step with decodes takes short prompts' tokens (at most that many pending) only
        up to this many tokens in all, the rest of a prompt in the next steps: the step size a model runs fastest
        (EngineConfig.max_mixed_step_tokens). A longer prompt is chunked by max_num_batched_tokens alone (cut
        into many small chunks, it would re-read its growing context every chunk)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be >= 1")
        if mixed_step_tokens is not None and (isinstance(mixed_step_tokens, bool)
                                              or not isinstance(mixed_step_tokens, int) or mixed_step_tokens < 1):
            raise ValueError(f"mixed_step_tokens must be a positive integer or None, got {mixed_step_tokens!r}")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.mixed_step_tokens = mixed_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[tuple[Sequence, list[int]]] = []   # waiting for these blocks to come up from disk
        self.by_id: dict[str, Sequence] = {}      # every sequence held here, waiting, loading or running
        self.num_preemptions = 0
        self.prefill_tokens = 0                   # prompt (or recomputed) tokens computed, all steps
        self.speculator, self.lookahead = speculator, lookahead
        self.spec_extra_tokens = 0                # tokens verification steps appended beyond one per sequence

    def add(self, seq: Sequence) -> None:
        why = self.blocks.capacity_error(len(seq.prompt_token_ids) + seq.max_tokens - 1)
        if why is not None:
            raise ValueError(f"request {seq.request_id!r} (prompt {len(seq.prompt_token_ids)} + max_tokens "
                             f"{seq.max_tokens}) {why}")
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def adopt(self, seq: Sequence) -> None:
        """A sequence whose KV is already in this rank's cache (its blocks held) joins the running batch."""
        self.running.append(seq)
        self.by_id[seq.request_id] = seq

    def release(self, seq: Sequence) -> None:
        """Take a running sequence out without freeing its blocks: the caller now owns them."""
        self.running.remove(seq)
        self.by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a sequence held here as aborted (its blocks freed); None if it is not here."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq)
        seq.abort()
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def _loaded(self) -> None:
        """Sequences whose disk reads are done rejoin the front of the queue, in their order. With
        nothing else to run, wait for the oldest one's reads (and let it go even if they are late)."""
        if not (self.waiting or self.running):
            s, hashes = self.loading[0]
            self.blocks.wait_reads(hashes, READ_TIMEOUT_S)
            late = {id(s)}
        else:
            late = set()
        back = [s for s, hashes in self.loading if id(s) in late or not self.blocks.reading(hashes)]
        self.loading = [(s, h) for s, h in self.loading if s not in back]
        self.waiting.extendleft(reversed(back))

    def _preempt_newest(self) -> Sequence:
        """Free the newest running sequence's blocks and put it back at the front of the queue."""
        victim = self.running.pop()
        self.blocks.free(victim)
        victim.preempt()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _grow_or_preempt(self, s: Sequence, n: int) -> bool:
        """Blocks for n more tokens of running sequence s, preempting the newest running sequences
        until they fit. -> False when s itself had to go (it is back in the queue)."""
        while not self.blocks.can_grow(s, n):
            if self._preempt_newest() is s:
                return False
        self.blocks.grow(s, n)
        return True

    def _drafts(self, s: Sequence, room: int) -> int:
        """Set s's drafts for this step (they fit the budget, its max_tokens and its blocks without
        preempting anyone) -> how many."""
        room = min(room, s.max_tokens - len(s.output_token_ids) - 1)   # the step appends drafts + 1 at most
        drafts = s.draft_token_ids = self.speculator.propose(s, room) if room > 0 else []
        if drafts and not self.blocks.can_grow(s, 1 + len(drafts)):
            drafts = s.draft_token_ids = []   # drafts never preempt a sequence
        return len(drafts)

    def _lookahead(self, s: Sequence, n: int, others: int) -> None:
        """Grow s's blocks `lookahead` slots past this step's n tokens if that leaves a free block for each of
        the `others` running sequences still to be scheduled (lookahead slots are optional: no preemption)."""
        need = self.blocks.missing(s, n + self.lookahead)
        if need > 0 and self.blocks.num_free - need >= others and self.blocks.can_grow(s, n + self.lookahead):
            self.blocks.grow(s, n + self.lookahead)

    def schedule(self) -> ScheduledBatch:
        if self.loading:
            self._loaded()
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_tokens: list[int] = []
        i, running, bs = 0, self.running, self.blocks.block_size
        # the room short prompts' chunks have in a step with decodes (mixed_step_tokens); None: no such limit
        mixed, cap = None, self.mixed_step_tokens
        if cap is not None:
            decoding = sum(1 for s in running if s.num_computed + 1 == s.num_tokens)
            if 0 < decoding < cap:
                mixed = cap - decoding
        # 1. running sequences, oldest first; make room by preempting the newest (which leaves the
        #    end of `running`, so index i stays valid and preempted sequences are never visited)
        spec = self.speculator
        if spec is not None:
            spec.begin(len(running))
        while i < len(running) and budget > 0:
            s = running[i]
            # num_pending and blocks.missing inlined: this loop visits every running sequence every step
            pending = len(s.prompt_token_ids) + len(s.output_token_ids) - s.num_computed
            n = min(pending, budget)
            if spec is not None and n == 1 and s.num_computed + 1 == s.num_tokens and s.output_token_ids:
                n += self._drafts(s, budget - 1)   # a decode: its drafts ride after its token
            elif mixed is not None and 1 < pending <= cap:   # a short prompt's chunk beside decodes
                n = min(n, mixed)
                if n <= 0:
                    i += 1
                    continue
                mixed -= n
            # a decode inside its last block needs no block: no checks (block_ids is a chain spec's one table; a spec
            # of several streams leaves it empty and always asks the block manager)
            if -(-(s.num_computed + n) // bs) <= len(s.block_ids) or self._grow_or_preempt(s, n):
                seqs.append(s)
                num_tokens.append(n)
                budget -= n
                if self.lookahead:   # the MTP drafter's later passes write there; never at the others' expense
                    self._lookahead(s, n, len(running) - i - 1)
            i += 1
        # 2. admit waiting sequences FCFS (a preempted one is back at the front)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            match = self.blocks.match_prefix(s)
            if match.reading:   # more of its prefix is coming up from disk: the others go first meanwhile
                self.blocks.free(s)
                s.num_computed = 0
                self.loading.append((self.waiting.popleft(), match.reading))
                continue
            n = min(s.num_pending, budget)
            if mixed is not None and s.num_pending <= cap:   # a short prompt beside decodes
                n = min(n, mixed)
                if n <= 0:
                    self.blocks.free(s)  # hand prefix hits back while it waits
                    s.num_computed = 0
                    break
                mixed -= n
            if not self.blocks.can_grow(s, n):
                self.blocks.free(s)  # hand prefix hits back while it waits
                s.num_computed = 0
                break
            self.blocks.record_query(s.num_tokens, match)
            if s.num_cached_tokens is None:   # usage.prompt_tokens_details.cached_tokens: the first admission's
                s.num_cached_tokens = match.tokens
            self.waiting.popleft()
            self.blocks.grow(s, n)
            if s.first_scheduled_time is None:
                s.first_scheduled_time = time.time()
            self.running.append(s)
            seqs.append(s)
            num_tokens.append(n)
            budget -= n
        return ScheduledBatch(seqs, num_tokens)

    def apply(self, batch: ScheduledBatch, result: StepResult) -> list[Sequence]:
        """Advance every sequence of the batch by what the runner computed (nano-vllm's postprocess):
        tokens now in the cache, prompt logprobs, the sampled token (and its finish check); hash
        the full blocks for the prefix cache; finished sequences leave and free their blocks (or,
        with hold_blocks, leave with them held).
        -> the sequences that produced a token or finished."""
        advanced = []
        now = time.time()
        b = self.blocks
        register = b.register_computed if b.enable_prefix_caching or b.register_every_step else None
        for s, n, tok, lp, top, plp, acc in zip(batch.seqs, batch.num_tokens, result.tokens, result.logprobs,
                                                result.top, result.prompt_logprobs, result.accepted or repeat(None)):
            if s.draft_token_ids:   # a verification: the last token and the accepted drafts are now computed
                self._verified(s, acc, tok, lp, top, now)
                advanced.append(s)
                if register is not None:
                    register(s)
                if s.finish_reason is not None:
                    self.release(s) if s.hold_blocks else self.finish(s)
                continue
            out = s.output_token_ids   # s.prefilling, inlined (every sequence, every step)
            pending = len(s.prompt_token_ids) + len(out) - s.num_computed
            if pending > 1 or not out and pending > 0:
                self.prefill_tokens += n
            s.num_computed += n
            if plp is not None:   # asked for (position 0 has none)
                if s.prompt_logprobs is None:
                    s.prompt_logprobs = [None]
                s.prompt_logprobs.extend(plp)
            if tok is not None:
                s.append(tok, lp, top, now)
                advanced.append(s)
            if register is not None:
                register(s)
            if s.finish_reason is not None:
                if s.hold_blocks:
                    self.release(s)
                else:
                    self.finish(s)
        return advanced

    def _verified(self, s: Sequence, acc: Accepted | None, tok: int, lp: float, top, now: float) -> None:
        """Apply a verification step of s (its last token + its drafts ran): the accepted drafts, then the
        target's own next token, each through the finish checks (a stop token among the accepted ends
        it there). The rejected drafts' cache slots lie past num_computed: the next step overwrites them."""
        drafted = len(s.draft_token_ids)
        s.draft_token_ids = []
        a = len(acc.tokens) if acc is not None else 0
        s.num_computed += 1 + a
        self.speculator.record(s, drafted, a)
        for i in range(a):
            s.append(acc.tokens[i], acc.logprobs[i], acc.top[i], now, grammar_end=False)
            if s.finish_reason is not None:
                self.spec_extra_tokens += i
                return
        s.append(tok, lp, top, now)
        self.spec_extra_tokens += a

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks."""
        if self.by_id.pop(seq.request_id, None) is not None:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            else:
                self.loading = [(s, h) for s, h in self.loading if s is not seq]
        self.blocks.free(seq)
