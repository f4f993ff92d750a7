"""The pools (attention_v4/paged.py) against the dense reference streams: the same outputs, bit for bit, for
sequences interleaved in steps of random chunk lengths over shuffled token blocks, blocks smaller than the HCA
ratio and larger than the CSA one; slots and blocks of other sequences untouched."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from attention_v4.paged import PagedSequence, V4Pools
from attention_v4.streams import SequenceStreams, V4Meta
from engine.model.build import load_model
from tests.oracle_v4 import PRO, make_v4_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("v4_paged"))
    make_v4_model(d, layer_types=PRO, seed=2, sliding_window=5)
    return load_model(d, progress=False)


@pytest.mark.parametrize("block_size", [8, 64])
@torch.no_grad()
def test_pools_equal_dense_streams(model, block_size):
    rng = random.Random(block_size)
    att, kinds = model.cfg.v4.attention, model.cfg.v4.layer_kinds
    lens = [70, 33, 101]
    per_seq = [-(-n // block_size) for n in lens]
    ids = list(range(sum(per_seq) + 3))
    rng.shuffle(ids)
    pools = V4Pools(att, kinds, len(ids), block_size, 4, "cpu", torch.float32)
    tables, at = [], 0
    for n in per_seq:
        tables.append(ids[at:at + n])
        at += n
    paged = [SequenceStreams(PagedSequence(pools, slot, t).layers) for slot, t in zip((3, 0, 2), tables)]
    dense = [model.new_streams() for _ in lens]
    tokens = [[rng.randrange(2, 200) for _ in range(n)] for n in lens]
    while any(s.num_tokens < n for s, n in zip(dense, lens)):
        live = [i for i, n in enumerate(lens) if dense[i].num_tokens < n]
        chunk = {i: min(rng.choice([1, 1, 3, 4, 9, 17, 30]), lens[i] - dense[i].num_tokens) for i in live}
        step = [t for i in live for t in tokens[i][dense[i].num_tokens:dense[i].num_tokens + chunk[i]]]
        outs = []
        for streams in (paged, dense):
            meta = V4Meta.build([chunk[i] for i in live], [streams[i] for i in live])
            outs.append(model(torch.tensor(step), meta))
        assert torch.equal(outs[0], outs[1])
    # the free slot and the spare blocks were never written
    spare = ids[sum(per_seq):]
    for layer in pools.layers:
        for name, t in layer.items():
            if name in ("compressed", "index_keys"):
                assert not t[spare].any()
            else:
                assert not t[1].any()
