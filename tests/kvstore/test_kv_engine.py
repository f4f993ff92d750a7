"""The tiered KV store in a running engine: a prefix spilled to the host tier or further to disk and
loaded back gives the same logprobs as a device-cache hit, bit for bit; a restart reuses the disk
tier; a damaged tier file is a miss (recomputed, the output unchanged); another model's tier is
never used; a request aborted while its prefix is read finishes cleanly; metrics and Prometheus."""
from __future__ import annotations

import glob
import os
import random

import pytest

from wideep.engine import SamplingParams
from wideep.engine.front.engine import Engine
from wideep.kvstore.hashing import hex_of, prefix_chain
from wideep.launch.server.prometheus import parse, render
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

BS = 16
BLOCK_BYTES = 4 * BS * 40 * 4          # the tiny model: 4 layers, latent 32 + rope 8, float32
rng = random.Random(11)
A = [rng.randrange(2, 256) for _ in range(70)]                       # 4 cacheable blocks
FILL = [[rng.randrange(2, 256) for _ in range(60)] for _ in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("kv")), arch="v3", seed=5, initializer_range=0.3)


def engine(model_dir, tmp_path=None, host_blocks=6, **kw):
    tiers = {"tiers": ["host", "disk"], "disk_dir": str(tmp_path)} if tmp_path is not None else {"tiers": ["host"]}
    return Engine(model_dir, progress=False, block_size=BS, kv_cache_blocks=12,
                  kv_cache=dict(tiers, host_bytes=host_blocks * BLOCK_BYTES, **kw))


def run(eng, rid, prompt, max_tokens=5):
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3))
    out = None
    while eng.has_unfinished_requests():
        out = next((o for o in eng.step() if o.finished), out)
    c = out.outputs[0]
    return c.token_ids, c.logprobs, c.cumulative_logprob


def stats(eng) -> dict:
    return eng.metrics()["per_rank"][0]


def test_spill_to_host_and_disk_then_reload_gives_identical_logprobs(model_dir, tmp_path):
    eng = engine(model_dir, tmp_path)
    first = run(eng, "a0", A)
    device = run(eng, "a1", A)                       # 64 of 70 tokens from the device cache
    assert stats(eng)["kv_hit_blocks_device"] == 4 and device[0] == first[0]
    hashes = prefix_chain(A, BS)
    for i, f in enumerate(FILL):                     # other prompts, until A's blocks left the device
        if not any(h in hashes for _, h in eng.core.blocks.cached_blocks()["latent"]):
            break
        run(eng, f"f{i}", f)
    assert all(h in eng.core.store.stores["latent"].host for h in hashes)
    host = run(eng, "a2", A)
    s = stats(eng)
    assert s["kv_hit_blocks_host"] == 4 and s["kv_spill_bytes_host"] > 0
    assert host == device                            # tokens, top logprobs, cumulative: bit for bit
    for i, f in enumerate(FILL):                     # 32 blocks: through host (6) down to disk
        run(eng, f"g{i}", f)
    assert not any(h in eng.core.store.stores["latent"].host
                   or h in dict(map(reversed, eng.core.blocks.cached_blocks()["latent"]))
                   for h in hashes)
    before = stats(eng)
    from_disk = run(eng, "a3", A)
    s = stats(eng)
    assert s["kv_hit_blocks_disk"] - before["kv_hit_blocks_disk"] == 4 and s["kv_disk_misses"] == 0
    assert s["kv_disk_reads"] - before["kv_disk_reads"] >= 4
    assert s["prefill_tokens"] - before["prefill_tokens"] == 70 - 64
    assert from_disk == device
    m = eng.metrics()
    assert m["kv_tiers"]["disk"]["hit_blocks"] == s["kv_hit_blocks_disk"] >= 4
    assert m["kv_tiers"]["host"]["hit_blocks"] == s["kv_hit_blocks_host"] >= 4
    assert m["prefill_tokens_total"] == s["prefill_tokens"] and m["routing_decisions"]["prefix"] >= 3
    text = render(m)
    p = parse(text)
    assert p['wideep_kv_tier_hit_blocks_total{tier="disk"}'] == s["kv_hit_blocks_disk"]
    assert p['wideep_kv_tier_blocks{tier="host"}'] == 6
    assert p['wideep_routing_decisions_total{reason="prefix"}'] == m["routing_decisions"]["prefix"]
    assert p["wideep_kv_disk_reads_total"] >= 4 and p["wideep_prefill_tokens_total"] == s["prefill_tokens"]
    assert "# TYPE wideep_kv_spill_bytes_total counter" in text
    eng.shutdown()


def test_restart_reuses_the_disk_tier(model_dir, tmp_path):
    eng = engine(model_dir, tmp_path)
    run(eng, "a0", A)
    device = run(eng, "a1", A)
    eng.shutdown()                                   # persist_on_close: the device blocks go to disk
    files = glob.glob(os.path.join(str(tmp_path), "*", "rank-0", "*.kv"))
    assert {hex_of(h) for h in prefix_chain(A, BS)} <= {os.path.basename(f)[:-3] for f in files}
    eng = engine(model_dir, tmp_path)
    assert run(eng, "b0", A) == device
    s = stats(eng)
    assert s["kv_hit_blocks_disk"] == 4 and s["prefill_tokens"] == 70 - 64
    eng.shutdown()
    eng = engine(model_dir, tmp_path, persist_on_close=False)
    eng.shutdown()
    eng = engine(model_dir, None)                    # no disk tier: nothing read
    run(eng, "c0", A)
    assert stats(eng)["prefill_tokens"] == 70
    eng.shutdown()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "garbage"])
def test_a_damaged_tier_file_is_a_miss(model_dir, tmp_path, damage):
    eng = engine(model_dir, tmp_path)
    device = [run(eng, "a0", A), run(eng, "a1", A)][1]
    eng.shutdown()
    eng = engine(model_dir, tmp_path)                # it finds the files, then one is damaged
    (path,) = glob.glob(os.path.join(str(tmp_path), "*", "rank-0", hex_of(prefix_chain(A, BS)[2]) + ".kv"))
    data = bytearray(open(path, "rb").read())
    if damage == "delete":
        os.unlink(path)
    else:
        with open(path, "wb") as f:
            f.write({"flip": data[:-9] + bytes([data[-9] ^ 1]) + data[-8:], "truncate": data[:len(data) // 2],
                     "garbage": b"\0" * len(data)}[damage])
    got = run(eng, "b0", A)
    s = stats(eng)
    assert s["kv_hit_blocks_disk"] == 2 and s["kv_disk_misses"] == 1   # blocks 0, 1; block 2 is recomputed
    assert s["prefill_tokens"] == 70 - 32
    assert got[0] == device[0] and got[2] == pytest.approx(device[2], abs=1e-4)
    eng.core.store.flush()
    assert not os.path.exists(path)                  # a damaged file is deleted
    eng.shutdown()


def test_another_models_tier_is_never_used(model_dir, tmp_path_factory, tmp_path):
    other = make_tiny_checkpoint(str(tmp_path_factory.mktemp("kv_other")), arch="v3", seed=6, initializer_range=0.3)
    eng = engine(model_dir, tmp_path)
    run(eng, "a0", A)
    eng.shutdown()
    alone = Engine(other, progress=False, block_size=BS, kv_cache_blocks=12, enable_prefix_caching=False)
    want = run(alone, "x", A)
    eng = engine(other, tmp_path)
    mine = eng.core.store.stores["latent"].disk.dir
    assert len(eng.core.store.stores["latent"].disk) == 0
    for f in glob.glob(os.path.join(str(tmp_path), "*", "rank-0", "*.kv")):   # model_dir's files, planted
        if os.path.dirname(f) != mine:
            os.link(f, os.path.join(mine, os.path.basename(f)))
    eng.shutdown()
    eng = engine(other, tmp_path, persist_on_close=False)
    assert len(eng.core.store.stores["latent"].disk) >= 4             # it sees the planted files ...
    got = run(eng, "b0", A)
    s = stats(eng)
    assert s["kv_hit_blocks_disk"] == 0 and s["kv_disk_misses"] >= 1 and s["prefill_tokens"] == 70
    assert got == want                               # ... and computes everything itself
    eng.shutdown()


def abort_while_reading(make, prompt, whole) -> None:
    """make(): an engine with a disk tier (the same directory each time); prompt cached by a first engine is
    aborted while the second reads it back; whole(core): nothing left held."""
    eng = make()
    run(eng, "a0", prompt)
    eng.shutdown()
    eng = make()
    eng.add_request("b0", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.step()
    assert [s.request_id for s, _ in eng.core.scheduler.loading] == ["b0"]
    eng.abort("b0")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not eng.core.scheduler.has_work() and whole(eng.core)
    eng.shutdown()


def test_abort_while_the_prefix_is_read(model_dir, tmp_path):
    abort_while_reading(lambda: engine(model_dir, tmp_path), A, lambda core: core.blocks.num_free == 12)


def test_dsa_index_keys_spill_and_reload_with_the_latents(tmp_path_factory, tmp_path):
    """DeepSeek-V3.2: each token's indexer key sits beside its latent; a block reloaded from the host
    and the disk tier brings both back (stale keys would change which tokens are selected: index_topk
    8 over a 70-token prompt)."""
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("kv_dsa")), arch="v32", seed=5, initializer_range=0.3,
                             index_topk=8)
    eng = Engine(d, progress=False, block_size=BS, kv_cache_blocks=12,
                 kv_cache=dict(tiers=["host", "disk"], disk_dir=str(tmp_path), host_bytes=6 * 2 * BLOCK_BYTES))
    pools = eng.core.kv.layer_pools(0)
    assert len(pools) == 2 and eng.core.store.stores["latent"].block_nbytes == sum(
        BS * p.shape[1] * p.element_size() for i in range(len(eng.core.kv.pools)) for p in eng.core.kv.layer_pools(i))
    device = (run(eng, "a0", A), run(eng, "a1", A))[1]
    hashes = prefix_chain(A, BS)
    for i, f in enumerate(FILL):
        if not any(h in hashes for _, h in eng.core.blocks.cached_blocks()["latent"]):
            break
        run(eng, f"f{i}", f)
    for p in eng.core.kv.index_pools:                # what the device held is gone: only the tiers have it
        p.normal_()
    assert run(eng, "a2", A) == device and stats(eng)["kv_hit_blocks_host"] == 4
    for i, f in enumerate(FILL):
        run(eng, f"g{i}", f)
    for p in eng.core.kv.index_pools:
        p.normal_()
    before = stats(eng)["kv_hit_blocks_disk"]
    assert run(eng, "a3", A) == device and stats(eng)["kv_hit_blocks_disk"] - before == 4
    eng.shutdown()
