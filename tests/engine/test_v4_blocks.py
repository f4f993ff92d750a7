"""The block manager (engine/sched/block_manager.py) over DeepSeek-V4's KV spec under the real scheduler, without a
model: a pool per stream with its own block size, admission and growth checking every pool (all or nothing), window
blocks going back as sequences advance (decode and chunked prefill), preemption under pressure on any one pool, and no
block or slot left held when every request is done."""
from __future__ import annotations

import random

import pytest

from wideep.attention_v4.pool_layout import v4_streams
from wideep.engine import SamplingParams
from wideep.engine.sched.scheduler import Scheduler, StepResult
from wideep.engine.sched.sequence import Sequence
from wideep.engine.sched.block_manager import BlockManager

GEO = v4_streams(window=7, block_size=4, ratios=(("csa", 4), ("hca", 16)))


def _seq(name: str, prompt: int, max_tokens: int) -> Sequence:
    return Sequence(name, None, list(range(1, prompt + 1)), SamplingParams(), max_tokens)


def _run(sched: Scheduler, blocks: BlockManager, check=None, limit: int = 2000) -> int:
    """Step until done, every running sequence's tables checked after each step; -> steps."""
    for step in range(limit):
        if not sched.has_work():
            return step
        batch = sched.schedule()
        assert batch.seqs, "the scheduler stalled"
        for s, n in zip(batch.seqs, batch.num_tokens):
            t = s.stream_tables
            assert set(t.window) >= GEO.window_blocks(s.num_computed, n, blocks.whole_chunks)
            for st in GEO.full:
                assert len(t.full[st]) >= GEO.entry_blocks(st, s.num_computed + n)
        toks = [7 if s.num_computed + n == s.num_tokens else None for s, n in zip(batch.seqs, batch.num_tokens)]
        B = len(batch.seqs)
        sched.apply(batch, StepResult(toks, [0.0 if t is not None else None for t in toks], [None] * B, [None] * B))
        for s in sched.running:
            assert set(s.stream_tables.window) == GEO.window_reads(s.num_computed)   # the rest went back
        if check is not None:
            check()
    raise AssertionError("did not finish")


def _empty(blocks: BlockManager) -> bool:
    return all(a.num_free == a.num_blocks for a in blocks.allocators.values()) and blocks.free_slots == blocks.num_slots


def test_geometry_block_sizes_per_stream():
    g = v4_streams(window=127, block_size=64, ratios=(("csa", 4), ("hca", 128)))
    assert (g.rows("window"), g.rows("csa"), g.rows("hca")) == (64, 16, 1)
    assert (g.tokens_per_block("csa"), g.tokens_per_block("hca")) == (64, 128)
    assert g.entry_blocks("hca", 1000) == 7 and g.entry_blocks("hca", 127) == 0   # one full row per 128 tokens
    assert g.window_blocks(1000, 1, False) == {13, 14, 15} and g.window_reads(1000) == {13, 14, 15}
    assert g.first_live(1022) == 13 and g.first_live(1023) == 14
    assert g.window_blocks(0, 8192, False) == {126, 127}     # a long chunk writes only its last W' tokens
    assert len(g.window_blocks(0, 8192, True)) == 128             # DBO: all of it (trimmed after the step)
    assert g.decode_window() == 3


@pytest.mark.parametrize("whole_chunks", [False, True])
def test_pressure_on_each_pool_preempts_and_leaks_nothing(whole_chunks):
    rng = random.Random(3 + whole_chunks)
    for short in ("window", "csa", "hca"):
        sizes = {"window": 40, "csa": 60, "hca": 60} | {short: {"window": 9, "csa": 20, "hca": 6}[short]}
        blocks = BlockManager(GEO, sizes, 4, 16, whole_chunks)
        sched = Scheduler(blocks, 4, 16)
        seqs = [_seq(f"{short}{i}", rng.randrange(3, 40), rng.randrange(10, 40)) for i in range(8)]
        for s in seqs:
            sched.add(s)

        def check():
            held = {st: sum(len(ids) for s in sched.running for ids in [s.stream_tables.held()[st]])
                    for st in GEO.streams}
            assert all(held[st] == blocks.allocators[st].num_blocks - blocks.allocators[st].num_free
                       for st in GEO.streams), "blocks held by no running sequence"
        _run(sched, blocks, check)
        assert all(s.finish_reason == "length" and len(s.output_token_ids) == s.max_tokens for s in seqs)
        assert sched.num_preemptions > 0, f"a short {short} pool was meant to preempt"
        assert _empty(blocks), f"blocks or slots left held ({short} pool short): {blocks.usage()}"


def test_grow_is_all_or_nothing():
    blocks = BlockManager(GEO, {"window": 20, "csa": 3, "hca": 20}, 2, 64)
    a, b = _seq("a", 32, 1), _seq("b", 32, 1)
    assert blocks.can_grow(a, 8)
    blocks.grow(a, 8)                       # csa: 2 entries, one per block; window: blocks 0, 1
    before = (blocks.usage(), dict(a.stream_tables.window), list(a.stream_tables.full["csa"]))
    assert not blocks.can_grow(b, 8)        # b needs 2 csa blocks, 1 is free (and window, hca blocks: they are)
    with pytest.raises(MemoryError, match=r"out of blocks for request 'b': csa: need 2, 1 free"):
        blocks.grow(b, 8)
    assert b.stream_tables is None and blocks.usage() == before[0], "a failed grow took something"
    c = _seq("c", 4, 1)
    blocks.grow(c, 4)
    with pytest.raises(MemoryError, match="no free DeepSeek-V4 slot"):
        blocks.grow(_seq("d", 4, 1), 4)
    for s in (a, c):
        blocks.free(s)
    assert _empty(blocks)


def test_long_chunked_prefill_returns_window_blocks_as_it_goes():
    blocks = BlockManager(GEO, {"window": 8, "csa": 40, "hca": 40}, 1, 16)
    sched = Scheduler(blocks, 1, 16)
    s = _seq("long", 150, 3)
    sched.add(s)
    peak = []
    _run(sched, blocks, lambda: peak.append(blocks.allocators["window"].num_blocks
                                            - blocks.allocators["window"].num_free))
    # 150 tokens of window-block demand (38 blocks of 4) through a pool of 8: after every step only the next
    # query's window (7 tokens: at most 3 blocks) is held
    assert max(peak) <= 3 and sched.num_preemptions == 0 and _empty(blocks)


def test_requests_that_never_fit_are_named():
    blocks = BlockManager(GEO, {"window": 6, "csa": 40, "hca": 2}, 2, 16)
    sched = Scheduler(blocks, 2, 16)
    with pytest.raises(ValueError, match=r"request 'x' \(prompt 40 \+ max_tokens 10\) needs 3 hca blocks, the pool "
                                         r"has 2"):
        sched.add(_seq("x", 40, 10))
    assert blocks.capacity_error(20) is None
    # chunks of 16 written whole (DBO): the 7 tokens read + 16 written span 8 blocks of 4
    assert BlockManager(GEO, {"window": 6, "csa": 40, "hca": 40}, 2, 16,
                        whole_chunks=True).capacity_error(40) == "needs 8 window blocks, the pool has 6"


@pytest.mark.parametrize("whole_chunks", [False, True])
def test_peak_bounds_every_step_of_one_sequence(whole_chunks):
    """capacity_error admits by geometry.peak: no chunking of a sequence alone ever needs more window blocks."""
    rng = random.Random(7)
    for _ in range(300):
        g = v4_streams(window=rng.randrange(0, 40), block_size=rng.choice([1, 2, 3, 4, 8, 16]), ratios=())
        tokens, max_chunk = rng.randrange(1, 200), rng.randrange(1, 64)
        c, held = 0, set()
        while c < tokens:
            n = min(rng.randrange(1, max_chunk + 1), tokens - c)
            held |= g.window_blocks(c, n, whole_chunks)
            assert len(held) <= g.peak(tokens, max_chunk, whole_chunks).get("window", 0), (g, tokens, max_chunk, c, n)
            c += n
            held = {j for j in held if j >= g.first_live(c)}
            assert held == g.window_reads(c)
