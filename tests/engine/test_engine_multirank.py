"""The serving engine on 2 and 4 DP ranks (gloo): random arrivals under memory pressure, one rank
idle for many steps; every output equals the request run alone, and no rank leaks a block."""
from __future__ import annotations

import pytest

from tests.engine.test_engine import alone, drive, workload
from tests.parallel.spawn import spawn


def requests() -> list[dict]:
    # one long request alone for the first 40 steps: the other ranks get nothing meanwhile
    first = dict(id="first", prompt=list(range(2, 30)), max_tokens=60, arrival=0)
    rest = workload(100, seed=7, max_prompt=200, max_new=40, last_arrival=60)
    for r in rest:
        r["arrival"] += 40
    return [first] + rest


def _rank(model_dir: str) -> dict:
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=30, max_num_seqs=16,
                 max_num_batched_tokens=128, parallel={"timeout_s": 60.0})
    if eng.ctx.rank != 0:
        how = eng.run_worker_loop()
        b = eng.core.blocks
        return {"how": how, "free": b.num_free, "total": b.allocators["latent"].num_blocks,
                "preemptions": eng.core.scheduler.num_preemptions}
    idle_steps = {"n": 0}

    def check(e):
        st = e.front.rank_stats   # each rank's latest report (they arrive asynchronously)
        if len(st) == e.ctx.world_size and st[0]["running"] \
                and all(st[r]["running"] == 0 and st[r]["waiting"] == 0 for r in range(1, e.ctx.world_size)):
            idle_steps["n"] += 1
    got = drive(eng, requests(), check)
    m = eng.metrics()
    eng.shutdown()
    return {"got": got, "idle_steps": idle_steps["n"], "metrics_preemptions": m["preemptions"],
            "free": eng.core.blocks.num_free, "total": eng.core.blocks.allocators["latent"].num_blocks}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("serve_mr")), arch="v3", seed=5, initializer_range=0.3)
    return d, alone(d, requests())


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 4])
def test_engine_on_dp_ranks_equals_alone(reference, dp):
    d, ref = reference
    ranks = spawn(_rank, dp, args=(d,), timeout_s=400)
    front = ranks[0]
    assert front["got"] == ref
    assert front["idle_steps"] >= 30, "the other ranks were meant to sit idle while the first request ran"
    assert front["metrics_preemptions"] > 0
    for r in ranks:
        assert r["free"] == r["total"]
    assert all(r["how"] == "shutdown" for r in ranks[1:])
