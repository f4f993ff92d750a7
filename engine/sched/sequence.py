"""A request's state on the rank that serves it. Never touches the device. (The front keeps its own
view, engine/front/outputs.py: text, what was reported to the client.)"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    """A request in flight. Compared and hashed by identity: two requests with equal fields are
    still two requests (and a field-by-field __eq__ made membership tests quadratic in the batch)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose latent is in the cache
    block_ids: list[int] = field(default_factory=list)   # its block table when the KV spec is a chain (one stream)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of its full computed blocks
    generator: torch.Generator | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None   # prompt tokens its first admission found in the prefix cache
    # metrics (wall clock: arrival is stamped by the front, the rest on the owning rank)
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_reported: int = 0            # output tokens already reported to the front
    hold_blocks: bool = False        # when it finishes, the scheduler releases it with its blocks held:
    #                                  their owner frees them (a prefill whose KV is still being sent)
    kv_prefetched: int = 0           # times its prefix's disk blocks were read (a chain spec: once; else at most
    #                                  twice)
    extra_metrics: dict = field(default_factory=dict)   # per-request figures of other parts (disaggregation)
    grammar: Any = None              # structured outputs: structured.rows.SequenceGrammar, made when it first samples
    draft_token_ids: list[int] = field(default_factory=list)   # speculative decoding: this step's drafts, verified
    #                                  after the last token (the scheduler sets them, apply clears them)
    spec: Any = None                 # the speculator's per-sequence state (engine/spec_decode/speculator.py SeqSpec)
    stream_tables: Any = None        # a KV spec that is not a chain: its slot and per-stream block
    #                                  tables (kvstore/spec.py StreamTables, given by engine/sched/block_manager.py;
    #                                  block_ids stays empty)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step asks for one token)."""
        P = len(self.prompt_token_ids)
        if start >= P:
            return self.output_token_ids[start - P:end - P]
        if end <= P:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - P]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: 1 for a decode, more while (re)filling a prompt."""
        return self.num_tokens - self.num_computed

    @property
    def prefilling(self) -> bool:
        return self.num_pending > 1 or not self.output_token_ids and self.num_pending > 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, top: dict[int, float] | None, now: float | None = None,
               grammar_end: bool = True) -> None:
        """now: the step's wall clock (one time.time() per step, not per token). grammar_end=False: the grammar
        took this token among a verification's (the runner fed it the step's tokens at once): its end, if any,
        is the step's last token's."""
        now = time.time() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if top is not None:
            self.logprobs.append(top)
        p = self.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            self.finish_reason = "stop"
        elif grammar_end and self.grammar is not None and self.grammar.finish is not None:
            self.finish_reason = self.grammar.finish   # the grammar ended (or refused the token)
        elif len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.finish_time = now

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.finish_time = "abort", time.time()

    def preempt(self) -> None:
        """Drop the cache; everything computed so far (prompt + outputs) is recomputed on re-admission."""
        self.num_computed = 0
        self.num_preemptions += 1
