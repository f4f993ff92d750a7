"""DeepSeek-V4's streams in the host and disk KV tiers (kvstore/store.py, engine/sched/block_manager.py): a prefix whose
blocks (window tail, compressed entries and indexer keys, the boundary state row) left the pools for the host tier
or further to disk is loaded back and gives the outputs of a device-cache hit bit for bit; a restart reuses the disk
tier; a damaged block file is a miss (recomputed, output unchanged); the 120-request replay under KV pressure with
the tiers equals the requests run alone and leaks nothing; a host tier too small for one block of every stream is
refused naming it; the rank tells the router about what its tiers hold."""
from __future__ import annotations

import glob
import os
import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.kvstore.hashing import hex_of, prefix_chain
from tests.oracle_v4 import PRO, make_v4_model

from tests.kvstore.test_kv_engine import abort_while_reading, run, stats  # (run: greedy, top-3 logprobs)

from .test_v4_prefix_cache import V4, _pools_whole, _replay, _workload

BS = 8
_rng = random.Random(21)
A = [_rng.randrange(2, 200) for _ in range(53)]   # the tiny V4's boundaries are every 16 tokens: 48 cached
FILL = [[_rng.randrange(2, 200) for _ in range(50)] for _ in range(24)]
HOST = 400_000   # bytes: ~26 boundaries' worth of every stream, fewer than FILL's
A_BLOCKS = 48 // 8 + 48 // 16 + 1 + 1   # what a hit at 48 takes: csa 6, hca 3, one window block (W' 7), a state row


@pytest.fixture(scope="module", params=["flash", "pro"])
def v4(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    make_v4_model(d, **({} if request.param == "flash" else dict(layer_types=PRO, seed=1)))
    return d


def engine(model_dir, disk_dir=None, host_bytes=HOST, kv_cache_dtype="auto", **kw):
    tiers = {"tiers": ["host", "disk"], "disk_dir": str(disk_dir)} if disk_dir is not None else {"tiers": ["host"]}
    return Engine(model_dir, block_size=BS, kv_cache_blocks=16, kv_cache_dtype=kv_cache_dtype,
                  kv_cache=dict(tiers, host_bytes=host_bytes, **kw), **V4)


def _named(eng, hashes) -> bool:
    return any(h in names for names in eng.core.blocks._by_hash.values() for h in hashes)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_spill_to_host_and_disk_then_reload_gives_identical_outputs(v4, tmp_path, kv):
    eng = engine(v4, tmp_path, kv_cache_dtype=kv)
    first = run(eng, "a0", A)
    device = run(eng, "a1", A)
    assert stats(eng)["kv_hit_blocks_device"] == A_BLOCKS and device[0] == first[0]
    hashes = prefix_chain(A, BS)
    for i, f in enumerate(FILL[:4]):   # other prompts, until A's blocks left the pools
        run(eng, f"f{i}", f)
    assert not _named(eng, hashes)
    host = run(eng, "a2", A)
    s = stats(eng)
    assert s["kv_hit_blocks_host"] == A_BLOCKS and s["kv_spill_bytes_host"] > 0
    assert s["prefill_tokens"] == 53 + 5 + 4 * 50 + 5
    assert host == device   # tokens, top logprobs, cumulative: bit for bit
    st = eng.core.store
    for i, f in enumerate(FILL):   # through the host tier down to disk
        run(eng, f"g{i}", f)
        if not any(h in t.host for t in st.stores.values() for h in hashes):
            break
    assert not _named(eng, hashes) and not any(h in t.host for t in st.stores.values() for h in hashes)
    before = stats(eng)
    from_disk = run(eng, "a3", A)
    s = stats(eng)
    assert s["kv_hit_blocks_disk"] - before["kv_hit_blocks_disk"] == A_BLOCKS and s["kv_disk_misses"] == 0
    assert s["prefill_tokens"] - before["prefill_tokens"] == 5
    assert from_disk == device
    m = eng.metrics()
    assert m["kv_tiers"]["disk"]["hit_blocks"] == A_BLOCKS   # (the second pass over FILL hits the host tier too)
    assert m["kv_tiers"]["host"]["hit_blocks"] == s["kv_hit_blocks_host"] >= A_BLOCKS
    eng.shutdown()
    off = LLM(v4, block_size=BS, enable_prefix_caching=False, kv_cache_dtype=kv, **V4)
    alone = off.generate([A], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert alone.outputs[0].token_ids == device[0]
    assert alone.outputs[0].cumulative_logprob == pytest.approx(device[2], abs=1e-4)


def test_restart_reuses_the_disk_tier(v4, tmp_path):
    eng = engine(v4, tmp_path)
    run(eng, "a0", A)
    device = run(eng, "a1", A)
    eng.shutdown()   # persist_on_close: the pools' named blocks go to disk, a directory per stream
    streams = eng.core.kv.spec.streams
    assert len(glob.glob(os.path.join(str(tmp_path), "*", "rank-0"))) == len(streams)
    eng = engine(v4, tmp_path)
    assert run(eng, "b0", A) == device
    s = stats(eng)
    assert s["kv_hit_blocks_disk"] == A_BLOCKS and s["prefill_tokens"] == 5
    eng.shutdown()
    eng = engine(v4, None)   # no disk tier: nothing read
    run(eng, "c0", A)
    assert stats(eng)["prefill_tokens"] == 53
    eng.shutdown()


def test_a_damaged_block_file_is_a_miss(v4, tmp_path):
    """The csa block of A's tokens 16..23 damaged: the hit stops at boundary 16, the rest is recomputed."""
    eng = engine(v4, tmp_path)
    device = [run(eng, "a0", A), run(eng, "a1", A)][1]
    eng.shutdown()
    eng = engine(v4, tmp_path)
    csa = eng.core.store.stores["csa"].disk.dir
    path = os.path.join(csa, hex_of(prefix_chain(A, BS)[2]) + ".kv")
    data = bytearray(open(path, "rb").read())
    with open(path, "wb") as f:
        f.write(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
    got = run(eng, "b0", A)
    s = stats(eng)
    assert s["kv_disk_misses"] == 1 and s["prefill_tokens"] == 53 - 16
    assert got[0] == device[0] and got[2] == pytest.approx(device[2], abs=1e-4)
    eng.core.store.flush()
    assert not os.path.exists(path)
    eng.shutdown()


def test_a_host_tier_smaller_than_one_block_of_each_stream_is_refused(v4):
    with pytest.raises(ValueError, match=r"kv_cache.host_bytes \(1000\) is shared by the DeepSeek-V4 streams "
                                         r"\['csa', 'hca', 'state', 'window'\] by their bytes per token; it must be "
                                         r"at least \d+ for one block of each"):
        engine(v4, host_bytes=1000)


def test_the_rank_reports_what_its_tiers_hold(v4):
    """KV-aware routing: a hash pushed out of the pools into the host tier is still held (no event saying it went)."""
    eng = engine(v4)
    b = eng.core.blocks
    run(eng, "a0", A)
    hashes = prefix_chain(A, BS)
    for i, f in enumerate(FILL[:4]):
        run(eng, f"f{i}", f)
    assert not _named(eng, hashes) and all(b.holds(h) for h in hashes[:6])
    eng.shutdown()


def test_abort_while_the_prefix_is_read(v4, tmp_path):
    abort_while_reading(lambda: engine(v4, tmp_path), A, _pools_whole)


@pytest.mark.slow
@torch.no_grad()
def test_120_requests_with_tiers_equal_alone_and_leak_nothing(v4, tmp_path):
    """The replay of test_v4_prefix_cache.py with a host tier (smaller than what is evicted: its LRU goes to disk)
    and a disk tier: every output equal to the request run alone, hits from the tiers, every pool whole after."""
    reqs = _workload(120, seed=7)
    eng = Engine(v4, block_size=8, kv_cache_blocks=40, max_num_seqs=8, max_num_batched_tokens=48,
                 kv_cache=dict(tiers=["host", "disk"], host_bytes=HOST, disk_dir=str(tmp_path)), **V4)
    core = eng.core
    got, params, _ = _replay(eng, reqs)
    s = stats(eng)
    assert s["preemptions"] > 0 and s["kv_hit_blocks_host"] + s["kv_hit_blocks_disk"] > 0
    assert _pools_whole(core), f"blocks left held: {core.blocks.usage()}"
    eng.shutdown()
    solo = LLM(v4, block_size=8, max_num_seqs=1, enable_prefix_caching=False, **V4)
    bad = [r["id"] for r in reqs if solo.generate([r["prompt"]], params[r["id"]])[0].outputs[0].token_ids
           != got[r["id"]]]
    assert not bad, f"{len(bad)} requests differ from running alone, e.g. {bad[:5]}"
