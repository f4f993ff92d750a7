"""attention_v4/decode.py: a decode step's sequences as one batch against the per-sequence reference
(attention.py), on the same pools: every step's output and, after the run, every pool tensor."""
from __future__ import annotations

import math
import random

import pytest
import torch

from wideep.attention_v4 import decode
from wideep.attention_v4.paged import PagedSequence, V4Pools
from wideep.attention_v4.pool_layout import v4_kv_spec
from wideep.attention_v4.streams import SequenceStreams, V4Meta
from wideep.engine import SamplingParams
from wideep.engine.model.families import load_model
from wideep.engine.sched.block_manager import BlockManager
from wideep.engine.sched.sequence import Sequence
from tests.oracle_v4 import FLASH, PRO, make_v4_model

W = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("v4_decode"))
    # every kind (HCA at ratio 8 closes windows within these contexts), odd sizes
    make_v4_model(d, layer_types=PRO[:2] + ["sliding_attention"] + FLASH[2:], seed=3, sliding_window=W,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                  mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"], index_topk=3)
    return load_model(d, progress=False, attention_backend="torch")


def _seq(i: int, n: int) -> Sequence:
    return Sequence(f"r{i}", None, [1] * n, SamplingParams(), 1)


def _batched(model, on: bool) -> None:
    for layer in model.layers:
        layer.attn.batched_decode = on


@pytest.mark.parametrize("block_size,kv_cache_dtype,prefix", [(2, "auto", False), (8, "auto", True),
                                                              (64, "auto", False), (8, "fp8", False)])
@torch.no_grad()
def test_batched_decode_equals_per_sequence(model, block_size, kv_cache_dtype, prefix):
    rng = random.Random(block_size)
    att, kinds = model.cfg.v4.attention, model.cfg.v4.layer_kinds
    geo = v4_kv_spec(att, kinds, block_size, prefix_caching=prefix)
    lens = [9, 61, 40, 23]
    max_chunk = 16
    sizes = {s: 4 * len(lens) * 70 for s in geo.streams}
    pools = [V4Pools(att, kinds, geo, sizes, 6, "cpu", torch.float32, kv_cache_dtype) for _ in range(2)]
    for p in pools:
        for layer in p.layers:
            for name, t in layer.items():
                t.fill_(math.nan if t.is_floating_point() else 0)
    blocks = BlockManager(geo, sizes, 6, max_chunk, False, enable_prefix_caching=prefix)
    seqs = [_seq(i, n) for i, n in enumerate(lens)]
    streams = [[None] * len(lens) for _ in pools]
    tokens = [[rng.randrange(2, 200) for _ in range(n)] for n in lens]
    done = [0] * len(lens)
    batched_steps = 0
    while any(d < n for d, n in zip(done, lens)):
        live = [i for i, n in enumerate(lens) if done[i] < n]
        # a short prompt first, then mostly decodes: all live sequences one token (the batched path)
        chunk = {i: (min(rng.choice([3, 5, 7]), lens[i] - done[i]) if done[i] == 0 else 1) for i in live}
        for i in live:
            blocks.grow(seqs[i], chunk[i])
            for k, p in enumerate(pools):
                if streams[k][i] is None:
                    streams[k][i] = SequenceStreams(PagedSequence(p, seqs[i].stream_tables).layers)
        step = torch.tensor([t for i in live for t in tokens[i][done[i]:done[i] + chunk[i]]])
        outs = []
        for k, on in enumerate((True, False)):
            _batched(model, on)
            meta = V4Meta.build([chunk[i] for i in live], [streams[k][i] for i in live])
            if on and decode.batchable(meta, 0):
                batched_steps += 1
            outs.append(model(step, meta))
        _batched(model, False)
        assert not outs[0].isnan().any()
        tol = 1e-4 if kv_cache_dtype == "auto" else 2e-3   # (fp8: a value rounded differently may move a code)
        torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
        for i in live:
            done[i] += chunk[i]
            seqs[i].num_computed += chunk[i]
            blocks.register_computed(seqs[i])
    assert batched_steps > 30
    for a, b in zip(pools[0].layers, pools[1].layers):
        for name in a:
            if a[name].is_floating_point():
                torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, equal_nan=True, msg=name)
            else:   # fp8 entries: the same codes but where rounding moved one
                assert (a[name] != b[name]).float().mean() < 0.01, name
