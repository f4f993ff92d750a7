"""The front's view of a request: what its DP rank reported so far, turned into RequestOutputs.

Ranks send per-step deltas (new tokens, their logprobs, the finish reason); the front accumulates
them here, detokenizes incrementally and builds vLLM-shaped RequestOutputs. Nothing here runs on a
rank's critical path: a slow front delays only its own clients, never the lockstep.

The front also holds everything needed to re-admit a request elsewhere (prompt, params, the
tokens produced so far): a rank's loss need not lose what it had accepted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import CompletionOutput, RequestOutput, SamplingParams
from ..worker.messages import Delta
from .stop_strings import StopMatcher

try:   # tokenizers >= 0.21: incremental decoding in Rust, one call per token
    from tokenizers.decoders import DecodeStream
except ImportError:   # pragma: no cover - older tokenizers: the decode-window fallback below
    DecodeStream = None


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    dp_rank: int
    arrival_time: float = field(default_factory=time.time)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    queue_s: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0                          # prompt tokens found in the prefix cache at admission
    extra_metrics: dict = field(default_factory=dict)   # e.g. disaggregation's transfer figures
    generator_state: bytes | None = None                # seeded sampling: after the last token received
    readmitted: int = 0                                 # times re-admitted after its rank was lost
    num_sent: int = 0          # tokens already reported (delta outputs)
    text: str = ""             # output text decoded so far
    text_sent: int = 0         # characters already reported (delta outputs)
    detok_prefix: int = 0      # text covers the tokens < detok_prefix (a later one may end a character)
    detok_read: int = 0        # tokens already fed to the detokenizer
    detok_stream: Any = None   # tokenizers' DecodeStream, when available
    index: int = 0             # which of the prompt's n samples (RequestOutput.outputs[i].index)
    group: Any = None          # engine/front/samples.py's SampleGroup when n > 1
    stop_reason: int | str | None = None
    stop_checked: int = 0      # text[:stop_checked] holds no stop string
    eos_token_ids: tuple = ()  # the model's EOS ids: a "stop" on one of them ends on a stop token
    stop_token_end: bool = False   # the last token is the EOS / stop token that ended it (no text)

    stops: StopMatcher | None = field(default=None, init=False)   # built once, with stop strings

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.stop:
            self.stops = StopMatcher(self.params.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, d: Delta, now: float | None = None) -> bool:
        """Add a rank's delta. -> whether the request advanced (new tokens or finished)."""
        now = time.time() if now is None else now
        toks = d.token_ids
        if toks:
            if self.first_token_time is None:
                self.first_token_time = now
            self.token_ids += toks
        if d.logprobs and self.logprobs is not None:
            self.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.cumulative_logprob = d.cumulative_logprob
        if d.queue_s is not None and self.queue_s is None:
            self.queue_s = d.queue_s
        if d.num_preemptions > self.num_preemptions:
            self.num_preemptions = d.num_preemptions
        if d.num_cached_tokens is not None and not self.num_cached_tokens:   # a re-admission keeps the first figure
            self.num_cached_tokens = d.num_cached_tokens
        if d.metrics:
            self.extra_metrics.update(d.metrics)
        if d.generator_state is not None:
            self.generator_state = d.generator_state
        reason = d.finish_reason
        if reason is None:
            return bool(toks)
        if self.finish_reason is None:
            self.finish_reason, self.finish_time = reason, now
            last = self.token_ids[-1] if self.token_ids else None
            if reason == "stop" and last is not None:
                p = self.params
                if last in p.stop_token_ids:
                    self.stop_reason = last
                # A grammar's end (structured outputs) is a "stop" on whatever token completed it.
                self.stop_token_end = self.stop_reason == last or (not p.ignore_eos and last in self.eos_token_ids)
        return True

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.finish_time = "abort", time.time()

    def metrics(self) -> dict:
        """TTFT (arrival at the front -> first token back at the front), TPOT, queue time (s)."""
        n = len(self.token_ids)
        first = self.first_token_time
        ttft = tpot = None
        if first is not None:
            ttft = first - self.arrival_time
            if self.finish_time is not None and n > 1:
                tpot = (self.finish_time - first) / (n - 1)
        m = {"ttft_s": ttft, "tpot_s": tpot, "queue_s": self.queue_s, "finish_reason": self.finish_reason,
             "prompt_tokens": len(self.prompt_token_ids), "output_tokens": n,
             "cached_tokens": self.num_cached_tokens, "preemptions": self.num_preemptions,
             "readmitted": self.readmitted}
        if self.extra_metrics:
            m.update(self.extra_metrics)
        return m

    def output(self, tokenizer, delta: bool = False) -> RequestOutput:
        """Cumulative (vLLM's default) or only what was not reported before (streaming)."""
        ids = self.token_ids
        start = self.num_sent if delta else 0
        toks = ids[start:]          # a new list: later tokens never alias into it
        lps = self.logprobs[start:] if self.logprobs is not None else None
        self.num_sent = len(ids)
        text = self._text(tokenizer, delta) if tokenizer is not None else ""
        reason = self.finish_reason
        comp = CompletionOutput(self.index, text, toks, self.cumulative_logprob, lps, reason, self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, [comp],
                             reason is not None, self.metrics())

    def detokenize(self, tokenizer) -> bool:
        """Decode the tokens not decoded yet and, with stop strings, look for one after each token.
        On a match the request finishes here ("stop", stop_reason the string): the text ends at the
        match (or after it, include_stop_str_in_output) and the tokens after the one that completed
        it are dropped. -> whether a stop string matched now (the front then aborts it on its rank)."""
        if tokenizer is None:
            return False
        stops = self.stops
        if stops is not None and self.detok_read < len(self.token_ids) and not isinstance(self.stop_reason, str):
            if self._match_stops(tokenizer, stops):
                return True
        if self.detok_read < len(self.token_ids) or self.finish_reason is not None:   # else up to date
            self._decode(tokenizer, len(self.token_ids))
        return False

    def _match_stops(self, tokenizer, stops: StopMatcher) -> bool:
        for i in range(self.detok_read, len(self.token_ids)):
            self._decode(tokenizer, i + 1)
            hit = stops.find(self.text, self.stop_checked)
            if hit is None:
                self.stop_checked = len(self.text)
                continue
            pos, matched = hit
            self.text = self.text[:pos + len(matched) if self.params.include_stop_str_in_output else pos]
            del self.token_ids[i + 1:]
            if self.logprobs is not None:
                del self.logprobs[i + 1:]
            self.detok_prefix = self.detok_read = len(self.token_ids)   # nothing left to flush
            self.finish_reason, self.stop_reason = "stop", matched
            self.stop_token_end = False   # it ends on the string, not on a stop token
            self.finish_time = self.finish_time or time.time()
            return True
        return False

    def _decode(self, tokenizer, end: int) -> None:
        """Advance self.text over token_ids[:end]. A character whose UTF-8 bytes span several tokens
        is held back until its last token arrives (or, never completed, shown as U+FFFD once the
        request ends). With tokenizers' DecodeStream each new token is one call; without it, a
        window of the last few tokens is decoded and the new text is the window's text minus the
        text of its already-decoded part (so tokenizers that treat a sequence's start specially
        still concatenate)."""
        ids = self.token_ids
        limit = len(ids) if self.finish_reason is None else self._text_end()
        end = min(end, limit)
        done = self.finish_reason is not None and end == limit
        skip = self.params.skip_special_tokens
        if DecodeStream is not None:
            if self.detok_stream is None:
                self.detok_stream = DecodeStream(skip_special_tokens=skip)
            for i in range(self.detok_read, end):
                chunk = self.detok_stream.step(tokenizer, ids[i])
                if chunk is not None:
                    self.text += chunk
                    self.detok_prefix = i + 1
            self.detok_read = max(self.detok_read, end)
            if done and self.detok_prefix < limit:   # bytes that never completed a character
                self.text += tokenizer.decode(ids[self.detok_prefix:limit], skip_special_tokens=skip)
                self.detok_prefix = limit
        elif end > self.detok_read:
            seen = tokenizer.decode(ids[self.detok_prefix:self.detok_read], skip_special_tokens=skip)
            window = tokenizer.decode(ids[self.detok_prefix:end], skip_special_tokens=skip)
            if len(window) > len(seen) and (done or not window.endswith("\ufffd")):
                self.text += window[len(seen):]
                self.detok_prefix, self.detok_read = self.detok_read, end

    def _text_end(self) -> int:
        """How many of the tokens have text: all but the stop token (EOS or one of stop_token_ids) that
        ended the request, unless include_stop_str_in_output (vLLM's rule)."""
        n = len(self.token_ids)
        if self.stop_token_end and not self.params.include_stop_str_in_output:
            return n - 1
        return n

    def _text(self, tokenizer, delta: bool) -> str:
        """The output text (or, for delta outputs, what was not reported yet). While the request
        runs, a tail that could still grow into a stop string is withheld."""
        running = self.finish_reason is None
        if self.detok_read < len(self.token_ids) or not running:   # else the text is up to date
            if self.stops is not None:   # (the front detokenized it already this step, looking for stops)
                self.detokenize(tokenizer)
            else:   # the common case, every request every step: straight to the decoder
                self._decode(tokenizer, len(self.token_ids))
        end = len(self.text)
        if running and self.stops is not None:
            end = max(self.text_sent if delta else 0, end - self.stops.hold)
        if not delta:
            return self.text[:end]
        new, self.text_sent = self.text[self.text_sent:end], max(self.text_sent, end)
        return new
