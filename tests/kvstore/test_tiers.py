"""The host and disk tiers on their own: exact bytes round trips, LRU within capacity, a disk file
that is missing, truncated, corrupt, renamed or another model's is a miss (never data), a restart
takes the files back, two engines never share a rank directory; the store spills and loads exact
rows; [kv_cache] values are checked with errors that show them."""
from __future__ import annotations

import os

import pytest
import torch

from wideep.kvstore.config import KVCacheConfig
from wideep.kvstore.disk import DiskTier, encode
from wideep.kvstore.events import HeldLog
from wideep.kvstore.host import HostTier
from wideep.kvstore.identity import model_identity
from wideep.kvstore.tier import StreamTier, device_block_bytes

ROWS = [(4, 6), (4, 3)]            # two "layers": block_size 4, widths 6 and 3
NBYTES = 4 * (6 + 3) * 4           # float32


def pools(num_blocks: int = 5, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks * 4, d, generator=g) for _, d in ROWS]


def wait(fut):
    return fut.result(timeout=30)


def test_host_tier_round_trips_and_evicts_lru_unpinned():
    p, q = pools(seed=1), [torch.zeros_like(t) for t in pools()]
    host = HostTier(2, ROWS, torch.float32, torch.device("cpu"))
    assert host.block_nbytes == NBYTES
    host.add(10)
    host.from_device(10, p, 3)
    host.to_device(10, q, 1)
    assert all(torch.equal(a[12:16], b[4:8]) for a, b in zip(p, q))
    assert host.to_bytes(10) == device_block_bytes(p, 3, 4)
    host.add(11)
    host.from_bytes(11, device_block_bytes(p, 0, 4))
    host.to_device(11, q, 2)
    assert all(torch.equal(a[0:4], b[8:12]) for a, b in zip(p, q))
    host.touch(10)
    assert host.victim() == 11
    host.pin(11)
    host.touch(11)
    assert host.victim() == 10
    host.pin(10)
    assert host.victim() is None and host.add(12) is None
    with pytest.raises(ValueError, match=f"a block is {NBYTES} bytes here, got 3"):
        host.from_bytes(10, b"abc")


def disk(tmp_path, identity="m" * 32, capacity_blocks=4, prefer=0) -> DiskTier:
    file_nbytes = len(encode(identity, 0, b"\0" * NBYTES))
    return DiskTier(str(tmp_path), identity, capacity_blocks * file_nbytes, NBYTES, prefer)


def test_disk_tier_reads_back_and_every_bad_file_is_a_miss(tmp_path):
    d = disk(tmp_path)
    payloads = {h: bytes([h]) * NBYTES for h in range(1, 7)}
    for h, data in payloads.items():
        d.write(h, data)
    assert len(d) == 4 and 1 not in d and 2 not in d        # LRU: the first two went
    assert wait(d.read_start(6))[:2] == (payloads[6], "ok")  # maybe still in memory
    d.flush()
    assert sorted(os.listdir(d.dir)) == sorted([os.path.basename(d.path(h)) for h in range(3, 7)] + ["lock"])
    assert wait(d.read_start(3))[:2] == (payloads[3], "ok")

    def damage(h, how):
        path = d.path(h)
        data = bytearray(open(path, "rb").read())
        if how == "flip":
            data[-5] ^= 0x40
        elif how == "truncate":
            data = data[:-7]
        with open(path, "wb") as f:
            f.write(data)
    damage(3, "flip")
    damage(4, "truncate")
    os.replace(d.path(5), d.path(2))           # a valid file under another block's name
    d._index[2] = None
    assert wait(d.read_start(3))[:2] == (None, "checksum mismatch")
    assert wait(d.read_start(4))[:2] == (None, "truncated")
    assert wait(d.read_start(2))[:2] == (None, "another block")
    assert wait(d.read_start(5))[:2] == (None, "missing")
    with open(d.path(6), "wb") as f:
        f.write(b"garbage")
    assert wait(d.read_start(6))[:2] == (None, "not a block file")
    d.close()


def test_disk_tier_restart_takes_files_back_and_models_and_engines_stay_apart(tmp_path):
    d = disk(tmp_path)
    for h in (1, 2, 3):
        d.write(h, bytes([h]) * NBYTES)
    with open(os.path.join(d.dir, "x.kv.123.tmp"), "wb") as f:
        f.write(b"half a file")
    other = disk(tmp_path)                     # the same model while the first runs: its own directory
    assert other.dir != d.dir and len(other) == 0 and other.dir.endswith("rank-1")
    other.close()
    d.close()
    again = disk(tmp_path, capacity_blocks=2)  # restart with less room: the most recent two stay
    assert again.dir == d.dir and again.hashes() == [2, 3]
    assert not any(n.endswith(".tmp") for n in os.listdir(again.dir))
    assert wait(again.read_start(3))[:2] == (bytes([3]) * NBYTES, "ok")
    again.close()
    model_b = disk(tmp_path, identity="n" * 32)
    assert len(model_b) == 0
    # a file of model m copied into model n's directory is still model m's
    src = os.path.join(str(tmp_path), "m" * 32, "rank-0", os.path.basename(model_b.path(3)))
    os.link(src, model_b.path(3))
    model_b._index[3] = None
    assert wait(model_b.read_start(3))[:2] == (None, "another model or format")
    model_b.close()
    with pytest.raises(ValueError, match=r"kv_cache.disk_bytes \(10\) is smaller than one block file"):
        DiskTier(str(tmp_path), "m" * 32, 10, NBYTES)


def test_store_spills_loads_and_reads_exact_rows(tmp_path):
    p = pools(num_blocks=6, seed=3)
    cfg = KVCacheConfig(tiers=("host", "disk"), host_bytes=2 * NBYTES, disk_dir=str(tmp_path))
    log = HeldLog()
    st = StreamTier(cfg, p, 4, "i" * 32, log=log)
    want = {h: device_block_bytes(p, h, 4) for h in range(4)}     # hash h <- device block h
    for h in range(4):
        st.spill(h, h)
    assert st.in_host([2, 3, 0]) == 2 and all(h in st.disk for h in (0, 1))
    for t in p:
        t.zero_()
    assert not st.load(0, 2) and device_block_bytes(p, 0, 4) == want[2]
    assert st.prefetch([0, 1, 9]) == [0, 1] and st.reading([1])
    st.wait([0, 1], 30)
    assert not st.reading([0, 1]) and st.in_host([0, 1]) == 2
    assert st.load(5, 1) and device_block_bytes(p, 5, 4) == want[1]   # came up from disk
    assert all(st.holds(h) for h in range(4)) and not st.holds(9)
    s = st.stats()
    assert s["kv_spills"] == 4 and s["kv_loads"] == 2 and s["kv_load_bytes_disk"] == 2 * NBYTES
    assert s["kv_disk_misses"] == 0 and s["kv_host_blocks"] == 2
    st.close([(5, 1)])
    with pytest.raises(ValueError, match=r"kv_cache.host_bytes \(10\) is smaller than one KV block \(144 bytes: "
                                         r"4 tokens x 36 bytes over 2 per-layer tensors\)"):
        StreamTier(KVCacheConfig(tiers=("host",), host_bytes=10), p, 4, None)


def test_identity_follows_weights_config_dtype_and_block_size(tmp_path):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    a = make_tiny_checkpoint(str(tmp_path / "a"), seed=1)
    b = make_tiny_checkpoint(str(tmp_path / "b"), seed=2)           # same config, other weights
    c = make_tiny_checkpoint(str(tmp_path / "c"), seed=1)           # a copy of a
    layout = [(16, 40)] * 4
    ia = model_identity(a, "torch.float32", 16, layout)
    assert ia == model_identity(c, "torch.float32", 16, layout)
    others = {model_identity(b, "torch.float32", 16, layout), model_identity(a, "torch.bfloat16", 16, layout),
              model_identity(a, "torch.float32", 32, [(32, 40)] * 4)}
    assert ia not in others and len(others) == 3
    with pytest.raises(FileNotFoundError, match="has no weight files"):
        model_identity(str(tmp_path), "torch.float32", 16, layout)


@pytest.mark.parametrize("bad, match", [
    (dict(tiers=["disk"]), r"the disk tier sits below the host tier\), got \['disk'\]"),
    (dict(tiers="host"), "must be a list of tier names, got 'host'"),
    (dict(tiers=["host", "disk"]), "kv_cache.disk_dir must name a directory, got None"),
    (dict(host_bytes=0), r"kv_cache.host_bytes must be an integer >= 1 \(bytes\), got 0"),
    (dict(routing="random"), "kv_cache.routing must be one of .*got 'random'"),
    (dict(route_load_weight=-1), "kv_cache.route_load_weight must be a number >= 0, got -1"),
    (dict(persist_on_close="yes"), "persist_on_close must be true or false"),
    (dict(tier=["host"]), r"unknown kv_cache keys \['tier'\]"),
])
def test_config_errors_show_the_values(bad, match):
    with pytest.raises(ValueError, match=match):
        KVCacheConfig.coerce(bad)


def test_engine_config_nests_kv_cache(tmp_path):
    from wideep.engine.engine_config import EngineConfig
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path / "m"))
    cfg = EngineConfig.from_sections({"model": {"path": d}, "kv_cache": {"tiers": ["host"], "routing": "least_loaded"}},
                                     world_size=1)
    assert cfg.kv_cache == KVCacheConfig(tiers=("host",), routing="least_loaded")
    assert "kv_cache" in EngineConfig.section_keys() and "tiers" in EngineConfig.section_keys()["kv_cache"]
    with pytest.raises(ValueError, match=r"\[kv_cache\] kv_cache.tiers must be one of"):
        EngineConfig.from_sections({"model": {"path": d}, "kv_cache": {"tiers": ["ssd"]}}, world_size=1)
    with pytest.raises(ValueError, match=r"unknown keys \['size'\] in \[kv_cache\]"):
        EngineConfig.from_sections({"model": {"path": d}, "kv_cache": {"size": 1}}, world_size=1)
    with pytest.raises(ValueError, match="they need enable_prefix_caching = true"):
        EngineConfig.from_options(d, world_size=1, enable_prefix_caching=False, kv_cache={"tiers": ["host"]})
