"""Disaggregated DeepSeek-V3.2: the indexer keys travel with the latents, layer by layer. 1 prefill +
1 decode rank: what the decode rank receives (latents and indexer keys of every layer, chunked prefills
and prefix-cache hits included) equals what it computes itself, and every request's tokens equal a
single process's (the decode steps select their top-k through the received keys)."""
from __future__ import annotations

import random

import pytest

from tests.disagg import prefill_hits
from tests.engine.test_engine import alone, drive, greedy
from tests.parallel.spawn import spawn

POOLS = {"prefill": {"dp_size": 1, "ep_size": 1, "max_num_batched_tokens": 32, "kv_cache_blocks": 24},
         "decode": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 40}}


def requests() -> list[dict]:
    rng = random.Random(5)
    system = [rng.randrange(2, 250) for _ in range(40)]  # 2 full blocks shared: prefix hits on the prefill rank
    reqs = [dict(id=f"s{i}", prompt=system + [rng.randrange(2, 250) for _ in range(5 + 9 * i)], max_tokens=8,
                 arrival=6 * i) for i in range(3)]
    reqs.append(dict(id="chunked", prompt=[rng.randrange(2, 250) for _ in range(110)], max_tokens=8, arrival=1))
    reqs.append(dict(id="short", prompt=[7, 9, 11], max_tokens=8, arrival=2))
    return reqs


def _rank(model_dir: str) -> dict | str:
    from wideep.attention_mla.kv_cache import gather_reference
    from wideep.engine.model.mla_cache import LatentCache
    from wideep.disagg import make_engine
    from wideep.engine.worker.messages import NewRequest
    from wideep.engine.worker.runner import ModelRunner
    from wideep.engine.sched.scheduler import ScheduledBatch
    from wideep.parallel import StepPlan
    eng = make_engine(model_dir, POOLS, progress=False, block_size=16, parallel={"timeout_s": 60.0})
    if not eng.is_front:
        return eng.run_worker_loop()
    core, bs = eng.core, 16
    L = len(core.kv.pools)
    received, finish = {}, eng.receiver._finish

    def spy(inc, trailer):
        n = len(inc.seq.prompt_token_ids)
        received[inc.seq.request_id] = [gather_reference(p, inc.seq.block_ids, n, bs).clone()
                                        for i in range(L) for p in core.kv.layer_pools(i)]
        finish(inc, trailer)
    eng.receiver._finish = spy
    reqs = requests()
    got = drive(eng, reqs)
    diffs = {}
    for r in reqs:  # the decode rank computes each prompt itself, into a scratch cache, and compares
        n = len(r["prompt"])
        kv = LatentCache(L, -(-n // bs), bs, core.kv.latent_dim, core.model.dtype, index_dim=core.kv.index_dim)
        seq = core.make_sequence(NewRequest(r["id"], r["prompt"], greedy(1), 1, 0.0))
        seq.block_ids = list(range(kv.num_blocks))
        ModelRunner(core.model, kv).execute(ScheduledBatch([seq], [n]), StepPlan(n))
        mine = [gather_reference(p, seq.block_ids, n, bs) for i in range(L) for p in kv.layer_pools(i)]
        diffs[r["id"]] = [(a - b).abs().max().item() / max(1.0, b.abs().max().item())
                          for a, b in zip(received[r["id"]], mine, strict=True)]
    hits = prefill_hits(eng)
    eng.shutdown()
    return {"got": got, "diffs": diffs, "hits": hits, "index_dim": core.kv.index_dim, "layers": L}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("disagg_dsa")), arch="v32", seed=5,
                                initializer_range=0.25, index_topk=8)


@pytest.mark.multirank
def test_index_keys_travel_with_the_latents(model_dir):
    front, prefill = spawn(_rank, 2, args=(model_dir,), timeout_s=300)
    assert prefill == "shutdown"
    assert front["index_dim"] == 32
    reqs = requests()
    assert front["got"] == alone(model_dir, reqs)
    assert front["hits"] > 0, "the shared prefix was meant to hit the prefill rank's cache"
    for rid, d in front["diffs"].items():
        assert len(d) == 2 * front["layers"]          # a latent and an indexer-key payload per layer
        assert max(d) <= 1e-5, (rid, d)
