"""n-gram speculative decoding on a disaggregated job (1 prefill + 1 decode rank): the decode rank drafts and
verifies the sequences whose prompts arrived by transfer (DeepSeek-V3, and DeepSeek-V4 whose streams arrive by
attention_v4/transfer.py and are then rewound after each verification); every greedy output equals a single process
without speculation, and drafts are accepted on the decode pool."""
from __future__ import annotations

import pytest

from tests.engine.test_engine import alone, drive
from tests.parallel.spawn import spawn

POOLS = {"prefill": {"dp_size": 1, "ep_size": 1, "max_num_batched_tokens": 48, "kv_cache_blocks": 24},
         "decode": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 40}}
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)


def requests(nxt) -> list[dict]:
    from wideep.launch.tiny.cycle import cycle_prompts
    prompts = cycle_prompts(nxt, 6, 30, seed=2)
    return [dict(id=f"r{i}", prompt=p[:12 + 7 * i], max_tokens=24, arrival=2 * i) for i, p in enumerate(prompts)]


def _rank(model_dir: str, nxt: list[int]) -> dict | str:
    from wideep.disagg import make_engine
    eng = make_engine(model_dir, POOLS, progress=False, block_size=16, speculative_config=NGRAM,
                      parallel={"timeout_s": 60.0})
    if not eng.is_front:
        return eng.run_worker_loop()
    got = drive(eng, requests(nxt))
    m = eng.metrics()
    eng.shutdown()
    return {"got": got, "drafts": m["spec_decode_num_draft_tokens"], "accepted": m["spec_decode_num_accepted_tokens"],
            "transfers": m["kv_transfers_total"]}


@pytest.fixture(scope="module", params=["v3", "v4"])
def cycle(request, tmp_path_factory):
    from wideep.launch.tiny.cycle import make_cycle_checkpoint, make_v4_cycle_checkpoint
    d = str(tmp_path_factory.mktemp(f"disagg_spec_{request.param}"))
    if request.param == "v4":
        pytest.importorskip("transformers")
        return make_v4_cycle_checkpoint(d, period=12, mix=0.25, gain=20.0, seed=1)
    return make_cycle_checkpoint(d, period=12, mix=2.0, gain=20.0, seed=1)


@pytest.mark.multirank
def test_ngram_drafts_on_the_decode_pool_equal_alone(cycle):
    d, nxt = cycle
    front, prefill = spawn(_rank, 2, args=(d, nxt), timeout_s=300)
    assert prefill == "shutdown"
    assert front["transfers"] == len(requests(nxt))
    assert front["got"] == alone(d, requests(nxt))
    assert 0 < front["accepted"] < front["drafts"], front
