"""Model runner: turns a scheduled batch into the model's inputs, runs the model, samples.

The only part of the engine that touches the device. Legend: T tokens this step, B sequences.
The step's inputs come from the KV cache (the model family's: engine/model/mla_cache.py, v4_cache.py), which knows
how its streams are addressed; the runner knows no family.
"""
from __future__ import annotations

import torch

from wideep.attention_mla.meta import int64_tensor
from wideep.parallel.step_plan import StepPlan

from ..sched.scheduler import ScheduledBatch, StepResult
from ..spec_decode.verify import verify
from ..sampling.logits_process import LogitsProcessor
from ..sampling.sampler import SampleLayout, sample, sample_layout, topn_logprobs


class ModelRunner:
    """overlap: a dbo.overlap.Overlap when dual-batch overlap is on; execute(batch, plan) with
    plan.split then runs the step as two microbatches whose all-to-alls hide behind each other's
    compute. The runner reads sequences and returns a StepResult; the scheduler applies it.
    drafter: speculative method "mtp"'s (engine/spec_decode/drafter.MTPDrafter), with the scheduler's speculator;
    grammars: -> the rank's grammar compiler (structured outputs), called when a row first needs it."""

    def __init__(self, model, kv, overlap=None, drafter=None, speculator=None, grammars=None):
        self.model, self.kv, self.overlap = model, kv, overlap
        self.drafter, self.speculator, self.grammars = drafter, speculator, grammars
        self.device = model.device
        self.logits_proc: LogitsProcessor | None = None   # built when a request first needs it
        self._rows_seqs: list = []                          # the last step's sampling rows (_sampling_rows)
        self._rows: tuple[SampleLayout, bool] | None = None

    def build_meta(self, batch: ScheduledBatch, parts: list[tuple[int, int, int]] | None = None):
        """-> input_ids [T] and the step's metadata for the batch, or for `parts` of it ((b, lo, hi): tokens lo..hi-1
        of sequence b's tokens this step): the KV cache's."""
        return self.kv.step_inputs(batch, parts)

    @torch.inference_mode()
    def dummy_step(self, plan: StepPlan) -> None:
        """A zero-token forward: this rank has no work but must still enter every MoE all-to-all
        (both microbatches' when the step is split)."""
        empty = ScheduledBatch([], [])
        if plan.split:
            self.overlap.forward([self.build_meta(empty, []), self.build_meta(empty, [])], self.kv.pools, plan,
                                 self.kv.index_pools)
        else:
            self.model(*self.build_meta(empty, []), self.kv.pools, plan, index_pools=self.kv.index_pools)
        if self.drafter is not None:
            self.drafter.dummy(plan)

    def _forward_split(self, batch: ScheduledBatch, plan: StepPlan) -> torch.Tensor:
        from wideep.dbo.split import split
        parts = split(batch.num_tokens)
        hidden = self.overlap.forward([self.build_meta(batch, p) for p in parts], self.kv.pools, plan,
                                      self.kv.index_pools)
        # back to the batch's token order: sequence b's rows lo..hi-1 sit at offset[b] + lo
        offset = [0]
        for n in batch.num_tokens:
            offset.append(offset[-1] + n)
        rows = torch.tensor([offset[b] + j for p in parts for b, lo, hi in p for j in range(lo, hi)],
                            device=self.device)
        out = torch.empty(offset[-1], hidden[0].shape[1], dtype=hidden[0].dtype, device=self.device)
        out[rows] = torch.cat(hidden)
        self.kv.after_split(batch)
        return out

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, plan: StepPlan, on_layer=None) -> StepResult:
        """Run one step as `plan` says (plan.split: two microbatches) -> what it computed for each
        sequence: the sampled token of those that caught up with their tokens (and the drafts a verification
        accepted before it), prompt logprobs. on_layer(i): called once layer i's latents are in the cache
        (not with split). With an MTP drafter, its passes follow (every rank, every step)."""
        B = len(batch.seqs)
        result = StepResult([None] * B, [None] * B, [None] * B, [None] * B)
        if not B:
            if self.drafter is not None:
                self.drafter.dummy(plan)
            return result
        if plan.split:
            hidden = self._forward_split(batch, plan)
        else:
            hidden = self.model(*self.build_meta(batch), self.kv.pools, plan, on_layer=on_layer,
                                index_pools=self.kv.index_pools)
        self._results(batch, hidden, result)
        self.kv.after_sampling(batch, result)   # DeepSeek-V4: verifications' streams keep the accepted drafts only
        if self.drafter is not None:
            self.drafter.draft(batch, hidden, result, plan, self.speculator)
        return result

    def _results(self, batch: ScheduledBatch, hidden: torch.Tensor, result: StepResult) -> None:
        """Sample (or verify) the rows of `hidden` [T, H] that predict a next token; prompt logprobs."""
        rows, samplers, tops, specs = [], [], [], []
        start = 0
        for b, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            p = s.params
            if p.prompt_logprobs is not None:
                result.prompt_logprobs[b] = self._prompt_logprobs(s, hidden[start:start + n])
            start += n
            if s.draft_token_ids:        # a verification: every row of it samples
                specs.append((b, start - n, n))
                continue
            # caught up (s.num_tokens, inlined): the last row predicts the next token
            if s.num_computed + n == len(s.prompt_token_ids) + len(s.output_token_ids):
                if p.logprobs is not None:
                    tops.append((len(samplers), b, p.logprobs))
                rows.append(start - 1)
                samplers.append(b)
        if specs:
            spec_rows = [r for _, lo, n in specs for r in range(lo, lo + n)]
            logits = self.model.logits(hidden.index_select(0, int64_tensor(rows + spec_rows, self.device)))
            vseqs = [batch.seqs[b] for b, _, _ in specs]
            guided = [j for j, s in enumerate(vseqs) if s.params.structured_outputs is not None]
            if guided:   # each row masked to the grammar after the drafts before it (in place, as for sampling)
                r = len(rows)
                offsets = []
                for _, _, n in specs:
                    offsets.append(r)
                    r += n
                grammar = self._logits_proc(logits.shape[1]).grammar_rows_()
                for j in guided:
                    grammar.mask_drafts(logits[offsets[j]:offsets[j] + specs[j][2]], vseqs[j])
            verify(logits[len(rows):], vseqs, [n - 1 for _, _, n in specs], [b for b, _, _ in specs], result)
            for j in guided:
                self._grammar_accept(vseqs[j], specs[j][0], result)
            if samplers:
                self._sample(batch, logits[:len(rows)], samplers, tops, result)
            return
        if not samplers:
            return
        # every row samples (a decode step): no gather
        every = len(rows) == hidden.shape[0]
        last = hidden if every else hidden.index_select(0, int64_tensor(rows, self.device))
        self._sample(batch, self.model.logits(last), samplers, tops, result)

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor, samplers: list[int], tops: list, result: StepResult
                ) -> None:
        """Sample the rows of `logits` [len(samplers), V]: row i is sequence samplers[i]'s next token."""
        B = len(batch.seqs)
        seqs = batch.seqs if len(samplers) == B else [batch.seqs[b] for b in samplers]
        layout, processed = self._sampling_rows(seqs)
        plan = None
        if processed:
            plan = self._logits_proc(logits.shape[1]).plan(seqs)
        if plan is not None and plan.grammar is not None:   # structured outputs: first, in place (vLLM's order)
            self.logits_proc.constrain(logits, plan)
        if plan is None or plan.grammar_only:
            tokens, lse = sample(logits, None, None, layout=layout)
        else:
            tokens, lse = sample(self.logits_proc.apply(logits, plan), None, None, raw=logits, layout=layout)
        if plan is not None:
            self.logits_proc.record(plan, tokens)
        chosen = (logits.gather(1, tokens[:, None]).squeeze(1) - lse).tolist()  # SYNC: tokens go back to the host
        if len(samplers) == B:
            result.tokens, result.logprobs = tokens.tolist(), chosen             # SYNC: see above
        else:
            for b, t, lp in zip(samplers, tokens.tolist(), chosen):              # SYNC: see above
                result.tokens[b], result.logprobs[b] = t, lp
        for i, b, n in tops:
            row = logits[i:i + 1] - lse[i:i + 1, None]                           # [1, V] raw logprobs
            result.top[b] = topn_logprobs(row, tokens[i:i + 1], n)[0]

    def _logits_proc(self, vocab: int) -> LogitsProcessor:
        if self.logits_proc is None:
            self.logits_proc = LogitsProcessor(vocab, self.device, self.grammars)
        return self.logits_proc

    @staticmethod
    def _grammar_accept(s, b: int, result: StepResult) -> None:
        """A verified sequence's grammar takes its tokens; if it ends on one of the accepted drafts, that
        draft becomes the step's last token (the ones after it are dropped)."""
        acc, g = result.accepted[b], s.grammar
        toks = acc.tokens + [result.tokens[b]]
        for i, t in enumerate(toks):
            g.accept(t)
            if g.finish is not None and i < len(acc.tokens):
                result.tokens[b], result.logprobs[b], result.top[b] = t, acc.logprobs[i], acc.top[i]
                del acc.tokens[i:], acc.logprobs[i:], acc.top[i:]
                return
            if g.finish is not None:
                return

    def _sampling_rows(self, seqs: list) -> tuple[SampleLayout, bool]:
        """-> (the sampler's layout of these rows, whether any needs logits processing), kept while
        the same sequences sample in the same order (a decode run): per-row work once, not per step."""
        if seqs != self._rows_seqs:   # identity comparison (Sequence has eq=False)
            params = [s.params for s in seqs]
            self._rows_seqs = list(seqs)
            self._rows = (sample_layout(params, [s.generator for s in seqs], self.device),
                          any(p.processed for p in params))
        return self._rows

    def _prompt_logprobs(self, s, hidden: torch.Tensor) -> list:
        """Row i of this chunk (position num_computed + i) predicts token num_computed + i + 1; the
        entries for prompt positions not recorded yet (a preempted sequence recomputes its rows)."""
        first = len(s.prompt_logprobs) if s.prompt_logprobs is not None else 1   # next position to record
        lo = first - 1 - s.num_computed                                          # its row in this chunk
        hi = min(hidden.shape[0], len(s.prompt_token_ids) - 1 - s.num_computed)
        if lo < 0 or hi <= lo:
            return []
        targets = s.prompt_token_ids[first:first + hi - lo]
        lp = self.model.logits(hidden[lo:hi]).log_softmax(-1)
        return topn_logprobs(lp, torch.tensor(targets, device=lp.device), s.params.prompt_logprobs)
