"""Naive (prefill) and absorbed (decode) MLA agree; paged reads equal a contiguous cache."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.config import MLAConfig, RopeConfig
from wideep.attention_mla.meta import AttnMeta
from wideep.attention_mla.mla import MLA
from wideep.attention_mla.rope import RotaryEmbedding


def _mla(q_lora: int | None, seed: int = 0) -> MLA:
    torch.manual_seed(seed)
    rope = RopeConfig(dim=8, kind="yarn", factor=4.0, original_max_position=16, mscale=0.9, mscale_all_dim=0.7)
    cfg = MLAConfig(hidden_size=48, num_heads=3, q_lora_rank=q_lora, kv_lora_rank=24, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=10, rope=rope)
    m = MLA(cfg, RotaryEmbedding(rope))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def _meta(lens: list[int], block_size: int, perm_seed: int = 1) -> AttnMeta:
    """Prefill of sequences of the given lengths into shuffled (non-contiguous) blocks."""
    nblocks = [-(-n // block_size) for n in lens]
    g = torch.Generator().manual_seed(perm_seed)
    perm = torch.randperm(sum(nblocks) + 3, generator=g).tolist()
    tables, pos, slots, k = [], [], [], 0
    for n, nb in zip(lens, nblocks):
        blocks = perm[k:k + nb]
        k += nb
        tables.append(blocks + [0] * (max(nblocks) - nb))
        pos += list(range(n))
        slots += [blocks[j // block_size] * block_size + j % block_size for j in range(n)]
    return AttnMeta(torch.tensor(pos), torch.tensor(slots), torch.tensor(tables), list(lens), list(lens), block_size)


@pytest.mark.parametrize("q_lora", [None, 20])
def test_naive_equals_absorbed_on_prefill(q_lora):
    m = _mla(q_lora)
    lens = [7, 1, 13]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), 48)
    outs = {}
    for mode in ("naive", "absorbed"):
        m.mode = mode
        pool = torch.zeros(64 * 4, 24 + 8)
        outs[mode] = m(x, meta, pool, *m.rope.cos_sin(meta.positions))
    torch.testing.assert_close(outs["naive"], outs["absorbed"], atol=1e-5, rtol=1e-5)


def test_decode_steps_equal_full_prefill():
    """Token-by-token decode through the paged cache (absorbed) == one prefill over the whole
    sequence (naive, contiguous attention), for every position."""
    m = _mla(20, seed=3)
    n, bs = 11, 4
    x = torch.randn(n, 48)
    full_meta = _meta([n], bs)
    full = m(x, full_meta, torch.zeros(16 * bs, 32), *m.rope.cos_sin(full_meta.positions))
    pool = torch.zeros(16 * bs, 32)
    table = full_meta.block_table
    steps = []
    for t in range(n):
        slot = int(table[0, t // bs]) * bs + t % bs
        meta = AttnMeta(torch.tensor([t]), torch.tensor([slot]), table, [1], [t + 1], bs)
        steps.append(m(x[t:t + 1], meta, pool, *m.rope.cos_sin(meta.positions)))
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_single_prefill():
    m = _mla(None, seed=5)
    n, bs = 13, 4
    x = torch.randn(n, 48)
    full_meta = _meta([n], bs)
    full = m(x, full_meta, torch.zeros(16 * bs, 32), *m.rope.cos_sin(full_meta.positions))
    pool, table, outs = torch.zeros(16 * bs, 32), full_meta.block_table, []
    for a, b in [(0, 5), (5, 6), (6, 13)]:
        pos = torch.arange(a, b)
        slots = torch.tensor([int(table[0, j // bs]) * bs + j % bs for j in range(a, b)])
        meta = AttnMeta(pos, slots, table, [b - a], [b], bs)
        outs.append(m(x[a:b], meta, pool, *m.rope.cos_sin(pos)))
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)
