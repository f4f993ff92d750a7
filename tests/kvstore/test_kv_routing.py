"""KV-aware routing end to end: the ranks' events reach the front's index, and a prompt whose prefix
one rank holds goes there (where least-loaded routing would pick another rank) — colocated DP ranks,
and the prefill pool of a disaggregated job; outputs equal each request run alone."""
from __future__ import annotations

import random
import time

import pytest

from wideep.kvstore.hashing import prefix_chain
from tests.engine.test_engine import alone, greedy
from tests.parallel.spawn import spawn

rng = random.Random(21)
FILLER = [rng.randrange(2, 250) for _ in range(40)]
PREFIX = [rng.randrange(2, 250) for _ in range(64)]          # 4 blocks of 16
FIRST, AGAIN = PREFIX + [7, 8, 9], PREFIX + [rng.randrange(2, 250) for _ in range(10)]
OTHER = [rng.randrange(2, 250) for _ in range(30)]


def _finish(eng, want: set[str]) -> dict:
    done = {}
    deadline = time.monotonic() + 120
    while not want <= set(done):
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        assert time.monotonic() < deadline, f"not finished: {want - set(done)}"
    return done


def _until_indexed(eng, rank: int) -> None:
    deadline = time.monotonic() + 60
    while eng.front.router.matched(prefix_chain(FIRST, 16), [rank])[rank] < 4:
        eng.step()
        assert time.monotonic() < deadline, "rank's blocks never reached the front's index"


def _settled_metrics(eng) -> dict:
    """A rank's stats ride on its reports: a prefill rank whose work ended without a token of its own
    to report sends them with its next (idle or periodic) report. Step until the hit shows."""
    deadline = time.monotonic() + 30
    while True:
        m = eng.metrics()
        per_rank = m["pools"]["prefill"]["per_rank"] if "pools" in m else m["per_rank"]
        if any(s.get("prefix_hit_tokens") for s in per_rank) or time.monotonic() > deadline:
            return m
        eng.step()


def _script(eng, pool: list[int]) -> dict:
    """FILLER and FIRST together (FIRST on the pool's second rank), then AGAIN (FIRST's prefix) and
    OTHER (nothing cached) once both finished."""
    ranks = {}

    def add(rid, prompt):
        eng.add_request(rid, prompt, greedy(6))
        ranks[rid] = eng.front.cost[rid][-1][1]      # the rank the front booked it on in the routed pool
    add("filler", FILLER)
    add("first", FIRST)
    got = _finish(eng, {"filler", "first"})
    _until_indexed(eng, ranks["first"])
    add("again", AGAIN)
    add("other", OTHER)
    got.update(_finish(eng, {"again", "other"}))
    m = _settled_metrics(eng)
    return {"got": got, "ranks": ranks, "pool": pool, "routing": m["routing_decisions"], "metrics": m}


def _colocated(model_dir: str):
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=40, parallel={"timeout_s": 60.0})
    if eng.ctx.rank != 0:
        return eng.run_worker_loop()
    out = _script(eng, [0, 1])
    out["hits"] = [s["prefix_hit_tokens"] for s in out.pop("metrics")["per_rank"]]
    eng.shutdown()
    return out


def _disagg(model_dir: str):
    from wideep.disagg import make_engine
    pools = {"prefill": {"dp_size": 2, "ep_size": 2, "kv_cache_blocks": 30}, "decode": {"dp_size": 1, "kv_cache_blocks": 40}}
    eng = make_engine(model_dir, pools, progress=False, block_size=16, parallel={"timeout_s": 60.0})
    if not eng.is_front:
        return eng.run_worker_loop()
    out = _script(eng, [1, 2])
    out["hits"] = [s["prefix_hit_tokens"] for s in out.pop("metrics")["pools"]["prefill"]["per_rank"]]
    eng.shutdown()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("route")), arch="v3", seed=5, initializer_range=0.3)


def _check(out: dict, model_dir: str, routing: dict) -> None:
    a, b = out["pool"]
    assert out["ranks"] == {"filler": a, "first": b, "again": b, "other": a}   # least-loaded would send again to a
    assert out["routing"] == routing
    assert out["hits"] == [0, 64]
    reqs = [dict(id=k, prompt=p, max_tokens=6) for k, p in
            (("filler", FILLER), ("first", FIRST), ("again", AGAIN), ("other", OTHER))]
    assert out["got"] == alone(model_dir, reqs)


@pytest.mark.multirank
def test_routing_picks_the_dp_rank_holding_the_prefix(model_dir):
    out, worker = spawn(_colocated, 2, args=(model_dir,), timeout_s=240)
    assert worker == "shutdown"
    _check(out, model_dir, {"no_prefix": 3, "prefix": 1})


@pytest.mark.multirank
def test_disagg_routes_to_the_prefill_rank_holding_the_prefix(model_dir):
    out, *workers = spawn(_disagg, 3, args=(model_dir,), timeout_s=300)
    assert workers == ["shutdown", "shutdown"]
    _check(out, model_dir, {"no_prefix": 3, "prefix": 1, "least_loaded": 4})   # decode ranks: by load
