"""Model runner: turns a scheduled batch into step metadata, runs the model, samples.

The only part of the engine that touches the device. Legend: T tokens this step, B sequences.
"""
from __future__ import annotations

import torch

from attention_mla.kv_cache import LatentKVPool
from attention_mla.meta import AttnMeta

from .model import DeepseekModel
from .sampler import sample, topn_logprobs
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: DeepseekModel, kv: LatentKVPool):
        self.model, self.kv = model, kv
        self.device = model.device

    def build_meta(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttnMeta]:
        """-> input_ids [T], AttnMeta for the batch."""
        bs = self.kv.block_size
        ids, pos, slots, ctx_lens = [], [], [], []
        for s, n in zip(batch.seqs, batch.num_tokens):
            start = s.num_computed
            toks = s.token_ids[start:start + n]
            ids.extend(toks)
            p = range(start, start + n)
            pos.extend(p)
            slots.extend(s.block_ids[j // bs] * bs + j % bs for j in p)
            ctx_lens.append(start + n)
        max_blocks = max(len(s.block_ids) for s in batch.seqs)
        table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in batch.seqs]
        dev = self.device
        meta = AttnMeta(positions=torch.tensor(pos, device=dev), slot_mapping=torch.tensor(slots, device=dev),
                        block_table=torch.tensor(table, device=dev), query_lens=list(batch.num_tokens),
                        ctx_lens=ctx_lens, block_size=bs)
        return torch.tensor(ids, device=dev), meta

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """A zero-token forward: this rank has no work but must still enter every MoE all-to-all."""
        dev = self.device
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        meta = AttnMeta(positions=empty, slot_mapping=empty, block_table=torch.zeros(0, 1, dtype=torch.int64, device=dev),
                        query_lens=[], ctx_lens=[], block_size=self.kv.block_size)
        self.model(empty, meta, self.kv.pools)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> None:
        """Run one step and advance every sequence in the batch (cache, outputs, finish state)."""
        if not batch.seqs:
            return
        input_ids, meta = self.build_meta(batch)
        hidden = self.model(input_ids, meta, self.kv.pools)
        sample_rows, samplers = [], []
        start = 0
        for s, n in zip(batch.seqs, batch.num_tokens):
            if s.params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[start:start + n])
            s.num_computed += n
            if s.num_computed == s.num_tokens:  # caught up: the last row predicts the next token
                sample_rows.append(start + n - 1)
                samplers.append(s)
            start += n
        if not samplers:
            return
        logits = self.model.logits(hidden[sample_rows])
        tokens, logprobs = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()  # SYNC: tokens go back to the host
        tops = [topn_logprobs(logprobs[i:i + 1], tokens[i:i + 1], s.params.logprobs)[0]
                if s.params.logprobs is not None else None for i, s in enumerate(samplers)]
        for s, t, lp, top in zip(samplers, tokens.tolist(), chosen, tops):  # SYNC: see above
            s.append(t, lp, top)

    def _prompt_logprobs(self, s, hidden: torch.Tensor) -> None:
        """Row i of this chunk (position num_computed + i) predicts token num_computed + i + 1; record
        the prompt positions not recorded yet (a preempted sequence recomputes its rows)."""
        if s.prompt_logprobs is None:
            s.prompt_logprobs = [None]
        first = len(s.prompt_logprobs)                     # next prompt position to record
        lo = first - 1 - s.num_computed                    # its row in this chunk
        hi = min(hidden.shape[0], len(s.prompt_token_ids) - 1 - s.num_computed)
        if lo < 0 or hi <= lo:
            return
        targets = s.prompt_token_ids[first:first + hi - lo]
        lp = self.model.logits(hidden[lo:hi]).log_softmax(-1)
        s.prompt_logprobs.extend(topn_logprobs(lp, torch.tensor(targets, device=lp.device), s.params.prompt_logprobs))
