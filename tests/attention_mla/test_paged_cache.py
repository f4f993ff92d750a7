"""Paged latent cache vs a contiguous per-sequence cache: the reference gather, the step path's
gather, and MLA attention reading through block tables all agree with the contiguous layout."""
from __future__ import annotations

import torch

from wideep.attention_mla.kv_cache import BlockAllocator, gather_reference
from wideep.attention_mla.meta import AttnMeta
from tests.attention_mla.test_mla import _mla


def _scatter_into_pool(contig: list[torch.Tensor], block_size: int, num_blocks: int):
    """Write each sequence's contiguous latents [L, D] into freshly allocated (shuffled) blocks."""
    alloc = BlockAllocator(num_blocks)
    alloc.allocate(3)  # make the ids start away from 0 and be non-contiguous
    D = contig[0].shape[1]
    pool = torch.zeros(num_blocks * block_size, D)
    tables = []
    for c in contig:
        blocks = alloc.allocate(-(-c.shape[0] // block_size))
        if len(tables) % 2:
            alloc.allocate(1)
        for j in range(c.shape[0]):
            pool[blocks[j // block_size] * block_size + j % block_size] = c[j]
        tables.append(blocks)
    return pool, tables


def test_gathers_equal_contiguous_cache():
    torch.manual_seed(0)
    bs, lens = 4, [9, 1, 16, 5]
    contig = [torch.randn(n, 12) for n in lens]
    pool, tables = _scatter_into_pool(contig, bs, 40)
    for c, t in zip(contig, tables):
        torch.testing.assert_close(gather_reference(pool, t, c.shape[0], bs), c, rtol=0, atol=0)
    width = max(len(t) for t in tables)
    meta = AttnMeta(torch.zeros(len(lens), dtype=torch.long), torch.zeros(len(lens), dtype=torch.long),
                    torch.tensor([t + [0] * (width - len(t)) for t in tables]), [1] * len(lens), lens, bs)
    slots, got_lens = meta.context_slots(list(range(len(lens))))
    assert got_lens.tolist() == lens
    for b, c in enumerate(contig):
        torch.testing.assert_close(pool[slots[b, :lens[b]]], c, rtol=0, atol=0)


def test_mla_through_block_tables_equals_contiguous_attention():
    """Decode one token per sequence with the latents already cached: MLA reading the paged pool
    == the two attention forms run directly on each sequence's contiguous cache."""
    m = _mla(20, seed=7)
    bs, lens = 4, [6, 11, 3]
    C, R = m.cfg.kv_lora_rank, m.cfg.qk_rope_head_dim
    x = torch.randn(len(lens), m.cfg.hidden_size)
    positions = torch.tensor([n - 1 for n in lens])
    cos, sin = m.rope.cos_sin(positions)
    q_nope, q_pe, latent = m.project(x, cos, sin)
    contig = [torch.randn(n, C + R) * 0.5 for n in lens]
    for b in range(len(lens)):
        contig[b][-1] = latent[b]  # the step writes its own latent at the last position
    pool, tables = _scatter_into_pool(contig, bs, 40)
    width = max(len(t) for t in tables)
    slot = [tables[b][(n - 1) // bs] * bs + (n - 1) % bs for b, n in enumerate(lens)]
    meta = AttnMeta(positions, torch.tensor(slot), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                    [1] * len(lens), lens, bs)
    with torch.no_grad():
        paged = m(x, meta, pool.clone(), cos, sin)
        for b, c in enumerate(contig):
            naive = m.attend_naive(q_nope[b:b + 1], q_pe[b:b + 1], c)
            absorbed = m.attend_absorbed(q_nope[b:b + 1], q_pe[b:b + 1], c[None], torch.tensor([lens[b]]))
            torch.testing.assert_close(naive, absorbed, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(paged[b:b + 1], m.o_proj(naive.reshape(1, -1)), atol=1e-5, rtol=1e-5)
