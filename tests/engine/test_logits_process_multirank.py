"""Logits processing on 2 DP ranks (gloo): penalised, biased and plain requests spread over both
ranks give what one process gives; each rank's sampler ran the processing for its own rows."""
from __future__ import annotations

import pytest

from tests.parallel.spawn import spawn
from tests.request_runs import run_in_one_process, run_on_front


def requests() -> list[tuple[str, list[int], dict]]:
    kinds = [dict(temperature=0.0),
             dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
             dict(temperature=1.0, seed=4, logit_bias={11: 3.0, 12: -5.0}, min_p=0.05),
             dict(temperature=0.8, seed=9, frequency_penalty=1.0, min_tokens=6)]
    return [(f"r{i}", [3 + i, 40, 7 * i + 1, 9], dict(max_tokens=12, ignore_eos=True, **kinds[i % 4]))
            for i in range(8)]


def _rank(model_dir: str) -> dict:
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, parallel={"timeout_s": 60.0})
    if eng.ctx.rank != 0:
        how = eng.run_worker_loop()
        return {"how": how, "processed": eng.core.runner.logits_proc is not None}
    got = {rid: c.token_ids for rid, c in run_on_front(eng, requests()).items()}
    processed = eng.core.runner.logits_proc is not None
    eng.shutdown()
    return {"got": got, "processed": processed}


@pytest.mark.multirank
def test_two_ranks_equal_one_process(tmp_path):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=5, initializer_range=0.3)
    want = {rid: c.token_ids for rid, c in run_in_one_process(d, requests(), block_size=16, kv_cache_blocks=64).items()}
    front, worker = spawn(_rank, 2, args=(d,), timeout_s=300)
    assert front["got"] == want
    assert worker["how"] == "shutdown"
    assert front["processed"] and worker["processed"]
