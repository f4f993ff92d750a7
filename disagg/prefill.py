"""A prefill-pool rank: the engine's step loop with hooks that stream each prompt's latent KV to
its decode rank, layer by layer.

Messages of one transfer (KVTransfer stream = the transfer id tid, prefill rank -> decode rank), in order:
    header {lo, hi, last}          before the chunk's forward: tokens lo..hi-1 follow
    L payloads [hi-lo, D]          layer i's latents, sent the moment layer i is done (Splitwise)
                                   (DSA: each followed by layer i's indexer keys [hi-lo, Dk]; DeepSeek-V4:
                                   layer i's pieces, attention_v4/transfer.py: the entries the chunk closed,
                                   and with the last chunk the window tail and the compressor states)
                                   (speculative method "mtp": one more layer, the MTP layer's, sent after the
                                   step: the drafter writes it once the target's forward is done)
    ... more chunks (chunked prefill, or a cached prefix sent first from the prefix cache) ...
    trailer {token, logprob, ...}  after sampling: the first token, the first drafts (MTP) and the prefill's timings
A finished prefill keeps its blocks until every send has completed, so a decode rank that cannot
take the KV yet holds this rank's cache, which in turn stops the scheduler from admitting more:
back-pressure, nothing dropped. Legend: L layers, D = kv_lora_rank + rope dim, T tokens.

MTP speculative decoding: the MTP layer's cache (the pool's last layer, engine/spec_decode/drafter.py) travels
with the target's, as vLLM and SGLang move the draft layer's KV with the prompt's. The prefill rank runs the
drafter's first pass over each chunk (row i: the target's hidden state at i and the token at i + 1, the
last row's being the first sampled token), so its latents (DSA: and its indexer keys) are complete when
the chunk's MTP payload leaves, and the last chunk's passes also give the first step's drafts: they ride in
the trailer and the decode rank verifies them in its first decode step. The alternative, sending the prompt's
final hidden states [T, H] for the decode rank to run that pass itself, would send more bytes per token than
the latent (H = 7168 > D = 576 on DeepSeek-V3) and put a prompt-length forward on the decode pool, whose steps
are meant to stay short. The prefill rank runs the pass for every prompt that may draft (its speculator never
turns drafting off: whether a sequence drafts is the decode rank's decision); a request that never drafts
(penalties, logit bias: speculator.can_draft) sends the layer's rows unwritten, and the decode rank never reads them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from wideep.engine.worker.messages import Abort, NewRequest
from wideep.engine.worker.rank_loop import RankHooks

from .kv_transfer import Handle, send_object


@dataclass
class _Job:
    tid: int
    dst: int                                   # global decode rank
    handles: list[Handle] = field(default_factory=list)
    sent_upto: int = 0                         # rows 0 .. sent_upto-1 are sent (or being sent)
    bytes: int = 0
    first_send: float | None = None            # time.time() of the first payload send
    layer_done: list[float] = field(default_factory=list)   # perf_counter, last chunk
    send_start: list[float] = field(default_factory=list)   # perf_counter, last chunk


class PrefillHooks(RankHooks):
    """Built on every prefill-pool rank and given to its Engine (the loop is the engine's own)."""

    def __init__(self, kv, rank: int):
        self.kv, self.rank = kv, rank              # KVTransfer; this rank's global rank
        self.core = None                           # set by attach once the engine is built
        self._jobs: dict[str, _Job] = {}           # request id -> job (prefilling or sending)
        self._sending: dict[str, object] = {}      # request id -> finished Sequence whose sends are in flight
        self.prefilled_tokens = 0
        self._t0 = 0.0
        self._chunks: list = []                    # this step's (job, slots, last chunk): the MTP layer's rows follow
        self.mtp_layer: int | None = None          # the MTP drafter's layer in the cache (method "mtp")

    def attach(self, core) -> None:
        """core: this rank's EngineCore (its speculator drafts whatever the batch: make_engine gave the prefill pool
        disable_by_batch_size None, so every prompt's MTP rows travel)."""
        self.core = core
        if core.drafter is not None:
            self.mtp_layer = core.config.num_hidden_layers

    # -- admission ----------------------------------------------------------------------------------
    def handle(self, msg) -> bool:
        if isinstance(msg, NewRequest):
            # The prefill computes the prompt and samples the first token (max_tokens 1); it leaves
            # the scheduler with its blocks held until the sends complete. The decode rank re-applies
            # the first token's stop checks when it appends it.
            seq = self.core.make_sequence(dataclasses.replace(msg, max_tokens=1))
            seq.hold_blocks = True
            self._jobs[seq.request_id] = _Job(msg.extra["tid"], msg.extra["dst"])
            self.core.scheduler.add(seq)
            return True
        if isinstance(msg, Abort):
            return True   # the decode rank finishes an aborted request once its transfer is through
        return False

    # -- around each step ---------------------------------------------------------------------------
    def before_schedule(self) -> list:
        self._reap()
        return []

    def has_pending(self) -> bool:
        return bool(self._sending)

    def _reap(self) -> None:
        """Free the blocks of finished prefills whose sends have all completed."""
        for rid, seq in list(self._sending.items()):
            job = self._jobs[rid]
            if all(h.done() for h in job.handles):
                self.core.blocks.free(seq)
                del self._sending[rid], self._jobs[rid]

    def _send_rows(self, job: _Job, chunk, layer: int) -> None:
        """Layer `layer`'s rows of a chunk (the KV cache's: KVCache.gather), each its own send."""
        if job.first_send is None:
            job.first_send = time.time()
        for r in self.core.kv.gather(chunk, layer):
            job.handles.append(self.kv.send_start(job.dst, job.tid, r))
            job.bytes += r.numel() * r.element_size()

    def on_layer(self, batch):
        """Headers now (before the forward); each layer's rows the moment the layer is done."""
        L = self.core.kv.transfer_layers   # a cached prefix: every cached layer's rows (the MTP layer's included)
        chunks = []  # (job, slots of this step's tokens, last chunk)
        for s, n in zip(batch.seqs, batch.num_tokens):
            job, lo = self._jobs[s.request_id], s.num_computed
            if lo > job.sent_upto:  # a prefix-cache hit: rows never sent for this request go first, from the cache
                job.handles += send_object(self.kv, job.dst, job.tid, {"lo": job.sent_upto, "hi": lo, "last": False})
                slots = self.core.kv.chunk(s, job.sent_upto, lo)
                for i in range(L):
                    self._send_rows(job, slots, i)
            job.sent_upto = max(job.sent_upto, lo + n)
            last = lo + n == len(s.prompt_token_ids)
            job.handles += send_object(self.kv, job.dst, job.tid, {"lo": lo, "hi": lo + n, "last": last})
            if last:
                job.layer_done, job.send_start = [], []
            chunks.append((job, self.core.kv.chunk(s, lo, lo + n, last), last))
        self._chunks = chunks
        self._t0 = time.perf_counter()
        self.prefilled_tokens += sum(batch.num_tokens)

        def on_layer(i: int) -> None:
            now = time.perf_counter()
            for job, slots, last in chunks:
                if last:
                    job.layer_done.append(now)
                    job.send_start.append(time.perf_counter())
                self._send_rows(job, slots, i)
        return on_layer

    def after_step(self, batch, advanced: list) -> list:
        """Prefills that sampled their first token have left the scheduler with their blocks held
        (hold_blocks) until the sends complete; send the trailer. Nothing is reported to the front:
        the decode rank reports the first token once the KV is there. With the MTP drafter, every chunk's
        MTP-layer rows go first (its first pass wrote them after the target's forward)."""
        if self.mtp_layer is not None:
            for job, slots, _ in self._chunks:
                self._send_rows(job, slots, self.mtp_layer)
        self._chunks = []
        t0 = self._t0
        stats = self.core.stats()
        for s in advanced:
            job = self._jobs[s.request_id]
            self._sending[s.request_id] = s
            gen = s.generator.get_state() if s.generator is not None and s.params.seed is not None else None
            trailer = {"token": s.output_token_ids[0], "logprob": s.cumulative_logprob,
                       "top": s.logprobs[0] if s.logprobs else None, "prompt_logprobs": s.prompt_logprobs,
                       "generator_state": gen, "mtp_drafts": list(s.spec.mtp_drafts) if s.spec is not None else [],
                       "prefill_start": s.first_scheduled_time, "first_send": job.first_send,
                       "bytes": job.bytes, "prefill_rank": self.rank, "prefill_stats": stats,
                       "layer_done_s": [t - t0 for t in job.layer_done],
                       "send_start_s": [t - t0 for t in job.send_start], "prefill_done": time.time()}
            job.handles += send_object(self.kv, job.dst, job.tid, trailer)
        return []

    def stats(self) -> dict:
        return {"role": "prefill", "prefilled_tokens": self.prefilled_tokens, "kv_sends_in_flight": len(self._sending)}
