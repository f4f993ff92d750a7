"""The KV spec (kvstore/spec.py) the families declare and the one store over its streams (kvstore/store.py): the MLA
family's one latent stream is a chain, DeepSeek-V4's streams are not; a spec that breaks its rules is refused naming
the streams; the store moves each stream's blocks as rows, exactly, and shares the tiers' bytes between several
streams by their bytes per token."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_v4.pool_layout import v4_streams
from wideep.kvstore.config import KVCacheConfig
from wideep.kvstore.spec import FULL, STATE, WINDOW, KVSpec, StreamSpec, StreamTables
from wideep.kvstore.store import TieredStore
from wideep.kvstore.tier import device_block_bytes


def latent(bs: int = 4) -> KVSpec:
    return KVSpec(bs, (StreamSpec("latent", FULL, rows=bs),), boundary=bs)


def test_latent_is_a_chain_and_v4_is_not():
    g = latent(16)
    assert g.chain and g.streams == ("latent",) and g.full == ("latent",) and g.window == 0
    assert g.entry_blocks("latent", 33) == 3 and g.peak(33, 8, False) == {"latent": 3}
    assert not g.window_reads(100) and g.decode_window() == 0
    v4 = v4_streams(window=7, block_size=4, ratios=(("csa", 4), ("hca", 16)), boundary=16)
    assert not v4.chain and v4.slots and v4.streams == ("window", "csa", "hca", "state")
    assert (v4.rows("csa"), v4.tokens_per_block("hca"), v4.tokens_per_block("state")) == (1, 16, 16)
    assert not KVSpec(4, (StreamSpec("latent", FULL, rows=4),), slots=True).chain   # a slot: not a chain
    t = StreamTables(0, {"csa": [3], "hca": []})
    t.window[2] = 5
    assert t.held() == {"window": [5], "csa": [3], "hca": []} and t.table("window") is t.window


def test_broken_specs_are_refused():
    with pytest.raises(ValueError, match=r"block_size must be >= 1, got 0"):
        KVSpec(0, ())
    with pytest.raises(ValueError, match=r"KV streams \['latent', 'latent'\]: names must be unique"):
        KVSpec(4, (StreamSpec("latent", rows=4), StreamSpec("latent", rows=4)))
    with pytest.raises(ValueError, match=r"not so: 'w' \(window\)$"):
        KVSpec(4, (StreamSpec("w", WINDOW, rows=4, window=3),))
    with pytest.raises(ValueError, match=r"state stream .* needs slots and a boundary \(slots False, boundary 8\)"):
        KVSpec(4, (StreamSpec(STATE, STATE, ratio=8),), boundary=8)


def _pools(num_blocks: int, shapes, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, *s, generator=g) for s in shapes]


def test_one_stream_store_moves_exact_rows():
    bs, N = 4, 6
    flat = _pools(N * bs, [(8,), (3,)], seed=1)               # latents and indexer keys: [S, D] rows per token
    blocks = [p.view(N, -1) for p in flat]                    # as the latent cache gives them: a row per block
    nbytes = bs * (8 + 3) * 4
    st = TieredStore(KVCacheConfig(tiers=("host",), host_bytes=2 * nbytes), latent(bs), {"latent": blocks})
    want = {b: device_block_bytes(flat, b, bs) for b in range(N)}
    st.spill("latent", 1, 11)
    st.spill("latent", 2, 12)
    st.spill("latent", 3, 13)                                 # the host holds 2: 11 goes
    assert st.where("latent", 12) == "host" and st.where("latent", 11) is None
    assert st.in_host("latent", [12, 13, 11]) == 2
    assert not st.load("latent", 5, 12) and device_block_bytes(flat, 5, bs) == want[2]
    s = st.stats()
    assert s["kv_spills"] == 3 and s["kv_loads"] == 1 and s["kv_host_blocks"] == 2
    assert not any(k.startswith("kv_host_blocks_") for k in s)   # one stream: no per-stream figures
    with pytest.raises(ValueError, match=r"kv_cache.host_bytes \(10\) is smaller than one KV block \(176 bytes: "
                                         r"4 tokens x 44 bytes over 2 per-layer tensors\)"):
        TieredStore(KVCacheConfig(tiers=("host",), host_bytes=10), latent(bs), {"latent": blocks})


def test_streams_share_the_host_bytes_by_their_bytes_per_token():
    spec = v4_streams(window=7, block_size=4, ratios=(("csa", 4), ("hca", 16)))
    pools = {"window": _pools(10, [(4, 8)], 2), "csa": _pools(10, [(1, 8), (1, 2)], 3), "hca": _pools(10, [(1, 8)], 4)}
    per_token = {"window": 4 * 8 * 4 / 4, "csa": 10 * 4 / 4, "hca": 8 * 4 / 16}
    host = 4000
    st = TieredStore(KVCacheConfig(tiers=("host",), host_bytes=host), spec, pools)
    total = sum(per_token.values())
    for s, tier in st.stores.items():
        assert tier.cfg.host_bytes == int(host * per_token[s] / total)
    st.spill("csa", 7, 99)
    assert st.where("csa", 99) == "host" and st.where("hca", 99) is None and st.holds(99)
    assert st.stats()["kv_host_blocks_csa"] == 1
    with pytest.raises(ValueError, match=r"kv_cache.host_bytes \(100\) is shared by the DeepSeek-V4 streams "
                                         r"\['csa', 'hca', 'window'\]"):
        TieredStore(KVCacheConfig(tiers=("host",), host_bytes=100), spec, pools)
