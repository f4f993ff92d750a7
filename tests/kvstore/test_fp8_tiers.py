"""The tiered store with an fp8 or fp4 latent cache: its packed rows spill to the host tier and come back bit
for bit, a restart reuses its disk tier, and a full-precision engine on the same disk_dir never reads them
(the cache dtype is part of the model identity), even when its files are planted in its directory; nor does
an fp4 engine read an fp8 one's."""
from __future__ import annotations

import glob
import os

import pytest

from wideep.engine.front.engine import Engine
from wideep.kvstore.hashing import prefix_chain
from tests.kvstore.test_kv_engine import A, BS, FILL, model_dir, run, stats  # noqa: F401 (fixture)

FP8_BLOCK_BYTES = 4 * BS * 68      # 4 layers x 16 tokens x (32 e4m3 + one float32 scale + 8 float32 RoPE)
FP4_BLOCK_BYTES = 4 * BS * 56      # (16 bytes e2m1 + 2 e4m3 scales, padded to 20, + a float32 scale + 8 RoPE)
BLOCK_BYTES = {"fp8": FP8_BLOCK_BYTES, "fp4": FP4_BLOCK_BYTES}


def engine(model_dir, tmp_path, kv_cache_dtype="fp8", **kw):
    host = 6 * BLOCK_BYTES.get(kv_cache_dtype, FP8_BLOCK_BYTES)
    return Engine(model_dir, progress=False, block_size=BS, kv_cache_blocks=12, kv_cache_dtype=kv_cache_dtype,
                  kv_cache=dict(dict(tiers=["host", "disk"], disk_dir=str(tmp_path), host_bytes=host), **kw))


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_packed_blocks_spill_reload_and_persist(model_dir, tmp_path, kv):
    eng = engine(model_dir, tmp_path, kv)
    assert eng.core.store.stores["latent"].block_nbytes == BLOCK_BYTES[kv]
    run(eng, "a0", A)
    device = run(eng, "a1", A)
    hashes = prefix_chain(A, BS)
    for i, f in enumerate(FILL):                     # other prompts, until A's blocks left the device
        if not any(h in hashes for _, h in eng.core.blocks.cached_blocks()["latent"]):
            break
        run(eng, f"f{i}", f)
    assert all(h in eng.core.store.stores["latent"].host for h in hashes)
    host = run(eng, "a2", A)
    assert stats(eng)["kv_hit_blocks_host"] == 4 and host == device       # bit for bit
    eng.shutdown()
    eng = engine(model_dir, tmp_path, kv)                                  # a restart: the disk tier
    again = run(eng, "a3", A)
    assert stats(eng)["kv_hit_blocks_disk"] == 4 and again == device
    eng.shutdown()


def test_fp8_and_full_precision_tiers_never_mix(model_dir, tmp_path):
    eng = engine(model_dir, tmp_path)
    run(eng, "a0", A)
    eng.shutdown()
    alone = Engine(model_dir, progress=False, block_size=BS, kv_cache_blocks=12, enable_prefix_caching=False)
    want = run(alone, "x", A)
    full = engine(model_dir, tmp_path, kv_cache_dtype="auto", host_bytes=6 * 4 * BS * 160)
    mine = full.core.store.stores["latent"].disk.dir
    assert len(full.core.store.stores["latent"].disk) == 0                 # another identity, another directory
    for f in glob.glob(os.path.join(str(tmp_path), "*", "rank-0", "*.kv")):   # the fp8 files, planted
        if os.path.dirname(f) != mine:
            os.link(f, os.path.join(mine, os.path.basename(f)))
    full.shutdown()
    full = engine(model_dir, tmp_path, kv_cache_dtype="auto", host_bytes=6 * 4 * BS * 160, persist_on_close=False)
    assert len(full.core.store.stores["latent"].disk) >= 4
    got = run(full, "b0", A)
    s = stats(full)
    assert s["kv_hit_blocks_disk"] == 0 and s["prefill_tokens"] == 70 and got == want
    full.shutdown()


def test_fp4_never_reads_fp8_blocks(model_dir, tmp_path):
    eng = engine(model_dir, tmp_path, "fp8")
    run(eng, "a0", A)
    eng.shutdown()
    fp4 = engine(model_dir, tmp_path, "fp4", persist_on_close=False)
    assert len(fp4.core.store.stores["latent"].disk) == 0                  # another identity, another directory
    run(fp4, "b0", A)
    assert stats(fp4)["kv_hit_blocks_disk"] == 0 and stats(fp4)["prefill_tokens"] == 70
    fp4.shutdown()
