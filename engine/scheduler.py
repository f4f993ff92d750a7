"""Per-rank scheduler: which sequences run this step and how many tokens each. Never touches the device.

Admission reserves a sequence's worst-case blocks (prompt + max_tokens) up front, so a running
sequence never runs out of cache; decodes go first, prefill chunks fill the rest of the token
budget (chunked prefill).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from attention_mla.kv_cache import BlockAllocator

from .sequence import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed this step per sequence


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator, self.block_size = allocator, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def blocks_needed(self, seq: Sequence) -> int:
        # the last sampled token is never fed back, so its latent is never cached
        return -(-(len(seq.prompt_token_ids) + seq.max_tokens - 1) // self.block_size)

    def add(self, seq: Sequence) -> None:
        if self.blocks_needed(seq) > self.allocator.num_blocks:
            raise ValueError(f"request {seq.request_id!r} needs {self.blocks_needed(seq)} KV blocks "
                             f"(prompt {len(seq.prompt_token_ids)} + max_tokens {seq.max_tokens}), "
                             f"the cache has {self.allocator.num_blocks}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        for s in self.running:
            if not s.prefilling and budget > 0:
                seqs.append(s)
                counts.append(1)
                budget -= 1
        for s in self.running:
            if s.prefilling and budget > 0:
                n = min(len(s.prompt_token_ids) - s.num_computed, budget)
                seqs.append(s)
                counts.append(n)
                budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.blocks_needed(self.waiting[0]) <= self.allocator.num_free):
            s = self.waiting.popleft()
            s.block_ids = self.allocator.allocate(self.blocks_needed(s))
            self.running.append(s)
            n = min(len(s.prompt_token_ids), budget)
            seqs.append(s)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
        elif seq in self.waiting:
            self.waiting.remove(seq)
