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


def test_token_tables_give_each_query_its_sequence_row_and_position():
    """Two chunks after cached contexts and a decode: one kernel row a query token, its sequence's table row, the
    keys up to its own position (the cache is written before it attends)."""
    table = torch.tensor([[4, 5, 0], [7, 0, 0], [1, 2, 3]])
    meta = AttnMeta(torch.tensor([3, 4, 5, 0, 9]), torch.arange(5), table, [3, 1, 1], [6, 1, 10], 4)
    t, lens, max_len = meta.token_tables([0, 1, 2])
    assert t.tolist() == [[4, 5, 0]] * 3 + [[7, 0, 0], [1, 2, 3]]
    assert lens.tolist() == [4, 5, 6, 1, 10] and lens.dtype == torch.int32 and max_len == 10
    assert meta.token_tables([2, 0])[1].tolist() == [10, 4, 5, 6]
    assert meta.attention_split("auto", True) == ([1, 2], [], [0])      # chunk 1: decodes only on the pages
    assert meta.attention_split("auto", True, 3) == ([0, 1, 2], [], [])
    assert meta.paged_decode_tables("auto") is None and meta.paged_decode_tables("auto", 5)[2] == 10


@pytest.mark.skipif(__import__("wideep.cpu.build", fromlist=["unusable"]).unusable() is not None,
                    reason="CPU kernels not built")
def test_the_cpu_backend_attends_short_steps_on_the_paged_kernel():
    """Backend "cpu": a step of at most PAGED_STEP_TOKENS tokens (prefills, a chunk after a cached context, a
    decode) attends every query on the paged C kernel, equal to the naive form; a longer step's prompts go naive."""
    from wideep.attention_mla import mla as mla_module
    from wideep.cpu.kernels import table
    from wideep.layers.kernels import Kernels
    m = _mla(20, seed=7)
    m.kernels = Kernels.from_table("cpu", table())
    lens = [7, 1, 13]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), 48)
    cos_sin = m.rope.cos_sin(meta.positions)
    outs = {}
    for mode, backend in (("naive", "torch"), ("auto", "cpu")):
        m.mode, m.backend = mode, backend
        outs[backend] = m(x, meta, torch.zeros(64 * 4, 32), *cos_sin)
    assert m.paged_chunk(sum(lens)) == sum(lens) and m.paged_chunk(mla_module.PAGED_STEP_TOKENS + 1) == 1
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=1e-5, rtol=1e-5)
    # the second chunk of a 13-token prompt after its cached first 6 tokens
    full = _meta([13], 4)
    pool = torch.zeros(64 * 4, 32)
    m(x[:6], AttnMeta(full.positions[:6], full.slot_mapping[:6], full.block_table, [6], [6], 4), pool,
      *m.rope.cos_sin(full.positions[:6]))
    chunk = AttnMeta(full.positions[6:], full.slot_mapping[6:], full.block_table, [7], [13], 4)
    got = m(x[6:13], chunk, pool, *m.rope.cos_sin(full.positions[6:]))
    m.mode, m.backend = "naive", "torch"
    want = m(x[:13], full, torch.zeros(64 * 4, 32), *m.rope.cos_sin(full.positions))[6:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
