"""The paged pools (attention_v4/paged.py, one per stream, tables from engine/sched/block_manager.py) against the dense
reference streams: the same outputs, bit for bit, for sequences interleaved in steps of random chunk lengths (chunks
ending mid-window, contexts up to 20 windows) with window blocks going back to a small pool as the sequences
advance and coming back to others (pools filled with NaN first: a row read before it is written would show), blocks
smaller than the window, the CSA and the HCA ratio and larger; slots and blocks never handed out untouched; every
pool empty again after."""
from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.attention_v4.paged import PagedSequence, V4Pools
from wideep.attention_v4.pool_layout import v4_kv_spec
from wideep.attention_v4.streams import SequenceStreams, V4Meta
from wideep.engine import SamplingParams
from wideep.engine.model.families import load_model
from wideep.engine.sched.sequence import Sequence
from wideep.engine.sched.block_manager import BlockManager
from tests.oracle_v4 import PRO, make_v4_model

W = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("v4_paged"))
    make_v4_model(d, layer_types=PRO[:2] + ["sliding_attention"] + PRO[2:], seed=2, sliding_window=W)
    return load_model(d, progress=False, attention_backend="torch")   # the reference: pools equal dense streams bit for bit


def _seq(i: int, n: int) -> Sequence:
    return Sequence(f"r{i}", None, [1] * n, SamplingParams(), 1)


@pytest.mark.parametrize("block_size,whole_chunks", [(2, False), (8, False), (8, True), (64, False)])
@torch.no_grad()
def test_pools_equal_dense_streams(model, block_size, whole_chunks):
    rng = random.Random(block_size + whole_chunks)
    att, kinds = model.cfg.v4.attention, model.cfg.v4.layer_kinds
    geo = v4_kv_spec(att, kinds, block_size)
    lens = [70, 33, 101]
    max_chunk = 30
    # the window pool holds what the three sequences need at once, no more: its blocks must be reused
    sizes = {"window": 3 * max(geo.peak(n, max_chunk, whole_chunks)["window"] for n in lens)}
    sizes |= {s: sum(geo.entry_blocks(s, n) for n in lens) + 2 for s in geo.full}
    pools = V4Pools(att, kinds, geo, sizes, 4, "cpu", torch.float32)
    for layer in pools.layers:
        for t in layer.values():
            t.fill_(math.nan)
    blocks = BlockManager(geo, sizes, 4, max_chunk, whole_chunks)
    blocks._free_slots = [1, 2, 0, 3]   # slots 3, 0, 2 in order; slot 1 never used
    seqs = [_seq(i, n) for i, n in enumerate(lens)]
    dense = [model.new_streams() for _ in lens]
    paged: list[SequenceStreams | None] = [None] * len(lens)
    tokens = [[rng.randrange(2, 200) for _ in range(n)] for n in lens]
    window_used, handed = set(), {s: set() for s in geo.streams}
    while any(s.num_tokens < n for s, n in zip(dense, lens)):
        live = [i for i, n in enumerate(lens) if dense[i].num_tokens < n]
        chunk = {i: min(rng.choice([1, 1, 3, 4, 9, 17, 30]), lens[i] - dense[i].num_tokens) for i in live}
        for i in live:
            assert blocks.can_grow(seqs[i], chunk[i])
            blocks.grow(seqs[i], chunk[i])
            if paged[i] is None:
                paged[i] = SequenceStreams(PagedSequence(pools, seqs[i].stream_tables).layers)
            for s, ids in seqs[i].stream_tables.held().items():
                handed[s] |= set(ids)
            window_used |= {(i, j) for j in seqs[i].stream_tables.window}
        step = [t for i in live for t in tokens[i][dense[i].num_tokens:dense[i].num_tokens + chunk[i]]]
        outs = []
        for streams in (paged, dense):
            meta = V4Meta.build([chunk[i] for i in live], [streams[i] for i in live])
            outs.append(model(torch.tensor(step), meta))
        assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
        for i in live:
            seqs[i].num_computed += chunk[i]
            blocks.register_computed(seqs[i])
            t, c = seqs[i].stream_tables, seqs[i].num_computed
            # only the blocks of the next query's window are left, the compressed streams hold what closed
            assert set(t.window) == geo.window_reads(c), (i, c)
            for s in geo.full:
                assert len(t.full[s]) == geo.entry_blocks(s, c)
    if block_size < 64:   # (blocks of 64 hold these contexts in two)
        assert len(window_used) > sizes["window"] and len(handed["window"]) == sizes["window"], \
            "window blocks that went back were handed out again"
    assert seqs[2].stream_tables.slot == 2 and {s.stream_tables.slot for s in seqs} == {0, 2, 3}
    for layer, stream_of in zip(pools.layers, pools.stream_of):   # the free slot, never-handed blocks: unwritten
        for name, t in layer.items():
            stream = stream_of.get(name)
            if stream is None:
                assert t[1].isnan().all(), name
            else:
                spare = sorted(set(range(sizes[stream])) - handed[stream])
                assert t[spare].isnan().all(), name
    for s in seqs:
        blocks.free(s)
    assert all(a.num_free == a.num_blocks for a in blocks.allocators.values()) and blocks.free_slots == 4
