"""1 prefill + 1 decode rank with kv_cache_dtype = "fp8" or "fp4": the packed latent rows travel as they are
(uint8 staging, the same bytes), and the outputs equal the same requests served by one colocated engine with
the same cache dtype."""
from __future__ import annotations

import pytest

from tests.disagg.test_disagg_cache import POOLS, requests
from tests.engine.test_engine import drive, greedy
from tests.parallel.spawn import spawn


ROW_BYTES = {"fp8": 68, "fp4": 56}   # the tiny V3's packed row a layer (tests/engine/test_fp4_kv_cache.py)


def _rank(model_dir: str, kv: str) -> dict | str:
    from wideep.disagg import make_engine
    eng = make_engine(model_dir, POOLS, progress=False, block_size=16, kv_cache_dtype=kv,
                      parallel={"timeout_s": 60.0})
    if not eng.is_front:
        return eng.run_worker_loop()
    got = drive(eng, requests()[4:])
    m = eng.metrics()
    eng.shutdown()
    return {"got": got, "pool_dtype": str(eng.core.kv.pools[0].dtype), "bytes_per_token": eng.core.kv.bytes_per_token(),
            "received": m["kv_transfer_bytes_total"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("disagg_fp8")), arch="v3", seed=5, initializer_range=0.1)


@pytest.mark.multirank
@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_packed_cache_transfers_and_serves_as_colocated(model_dir, kv):
    from wideep.engine import LLM
    front, prefill = spawn(_rank, 2, args=(model_dir, kv), timeout_s=240)
    assert prefill == "shutdown"
    reqs = requests()[4:]
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=64, kv_cache_dtype=kv,
              enable_prefix_caching=False)
    want = {r["id"]: llm.generate([r["prompt"]], greedy(r["max_tokens"]))[0].outputs[0].token_ids for r in reqs}
    assert front["got"] == want
    row = ROW_BYTES[kv]
    assert front["pool_dtype"] == "torch.uint8" and front["bytes_per_token"]["latent"] == 4 * row
    assert front["received"] == sum(len(r["prompt"]) for r in reqs) * 4 * row   # packed rows, nothing else
