"""Resizing on request through the Python API (Engine.start_resize): 4 ranks serving a stream of requests shrink
to 3, then to 1, while requests keep arriving; every request finishes with exactly the tokens of one process
(greedy: the leaving ranks' requests moved and were recomputed), the expert placement is re-planned for each new
size, the leaving ranks' loops end with "left", no KV block leaks, and the errors leave the engine serving."""
from __future__ import annotations

import random

import pytest

from tests.engine.test_engine import greedy
from tests.parallel.spawn import spawn

PARALLEL = {"num_redundant_experts": 4, "timeout_s": 30.0, "heartbeat_s": 0.5}
OPTS = dict(progress=False, block_size=8, kv_cache_blocks=96, max_num_seqs=16, max_num_batched_tokens=96)


def requests(n: int = 32) -> list[dict]:
    rng = random.Random(7)
    return [dict(id=f"q{i}", prompt=[rng.randrange(2, 250) for _ in range(rng.randint(3, 30))],
                 max_tokens=rng.randint(8, 24), arrival=i // 2) for i in range(n)]


class _BrokenLauncher:
    """A launcher that cannot start ranks (launch/cli/spawn_link.py Spawner's surface)."""
    most = 4

    def start(self, origins, world, env):
        raise RuntimeError(f"no room for ranks {origins}")


def _serve(model_dir: str, sizes: tuple[int, ...], resize_at: tuple[int, ...]) -> dict:
    """Every rank (one process without RANK). Rank 0 feeds requests(), asks for sizes[i] at step resize_at[i]."""
    import os

    from wideep.engine.front.engine import Engine
    from wideep.engine.front.resize import ResizeConflict, ResizeError
    multi = "RANK" in os.environ
    eng = Engine(model_dir, **dict(OPTS, parallel=PARALLEL if multi else {}),
                 spawner=_BrokenLauncher() if multi and os.environ["RANK"] == "0" else None)
    if not eng.is_front:
        how = eng.run_worker_loop()
        b = eng.core.blocks
        return {"how": how, "free": b.num_free, "total": b.num_blocks}
    reqs = requests()
    by_step: dict[int, list] = {}
    for r in reqs:
        by_step.setdefault(r["arrival"], []).append(r)
    done, step, results, refused, asks = {}, 0, [], [], dict(zip(resize_at, sizes))
    while step <= max(by_step) or eng.has_unfinished_requests() or eng.resizing or asks:
        for r in by_step.get(step, []):
            eng.add_request(r["id"], r["prompt"], greedy(r["max_tokens"]))
        if step in asks and not eng.resizing:
            assert eng.start_resize(asks.pop(step)) is None
            for bad, kind in ((0, ResizeError), ("2", ResizeError), (True, ResizeError), (2, ResizeConflict),
                              (8, ResizeConflict)):
                try:
                    eng.start_resize(bad)
                except kind as e:
                    refused.append(str(e))
        elif step in asks:
            asks[step + 1] = asks.pop(step)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out.outputs[0].token_ids
        res = eng.resize_result()
        if res is not None:
            results.append(dict(res, world=eng.ctx.world_size))
        step += 1
        assert step < 20000
    for bad in (2, 8):   # more ranks than run now: its launcher cannot start any, or more than it may run
        try:
            eng.start_resize(bad)
        except ResizeError as e:
            refused.append(str(e))
    if sizes:
        assert eng.start_resize(eng.ctx.world_size)["resize_s"] == 0.0   # today's size: nothing to do
    eng.shutdown()
    b = eng.core.blocks
    return {"got": done, "results": results, "refused": refused, "free": b.num_free, "total": b.num_blocks}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("resize")), arch="v3", seed=5, initializer_range=0.3)


@pytest.mark.multirank
def test_shrink_4_to_3_to_1_while_serving(tiny):
    alone = _serve(tiny, (), ())["got"]
    outs = spawn(_serve, 4, args=(tiny, (3, 1), (6, 14)), timeout_s=240)
    front = outs[0]
    assert front["got"] == alone                       # all 32, token for token
    first, second = front["results"]
    assert (first["old_data_parallel_size"], first["new_data_parallel_size"], first["left"]) == (4, 3, [3])
    assert (second["old_data_parallel_size"], second["new_data_parallel_size"], second["left"]) == (3, 1, [1, 2])
    assert first["world"] == 3 and second["world"] == 1
    # 16 experts + 4 redundant over 4 ranks (5 slots) -> 3 ranks x 6 slots -> 1 rank x 16 slots
    assert (first["slots_per_rank"], first["num_physical"]) == (6, 18)
    assert (second["slots_per_rank"], second["num_physical"]) == (16, 16)
    assert first["expert_bytes_checkpoint"] == 0 and first["expert_bytes_peer"] > 0
    assert first["requests_moved"] + second["requests_moved"] > 0
    assert all(r["resize_s"] < 30 for r in front["results"])
    assert [o["how"] for o in outs[1:]] == ["left", "left", "left"]
    refused = front["refused"]
    assert len(refused) == 12, refused
    assert "must be >= 1, got 0" in refused[0] and "must be an integer >= 1, got '2'" in refused[1]
    assert "must be an integer >= 1, got True" in refused[2]
    assert "already running" in refused[3] and "already running" in refused[4]
    assert "cannot grow from 1 to 2 ranks: the launcher could not start ranks: no room for ranks [4]" in refused[10]
    assert "new_data_parallel_size (8) is more ranks than this deployment can run: at most 4" in refused[11]
    assert front["free"] == front["total"], "KV blocks leaked"


def _disagg(model_dir: str) -> dict:
    """A prefill rank and a decode rank (rank 0, the front): a resize is refused, and serving goes on."""
    from wideep.disagg import make_engine
    from wideep.engine.front.resize import ResizeError
    pools = {"prefill": {"dp_size": 1, "ep_size": 1}, "decode": {"dp_size": 1, "ep_size": 1}}
    eng = make_engine(model_dir, pools, progress=False, parallel={"timeout_s": 30.0})
    if not eng.is_front:
        return {"how": eng.run_worker_loop()}
    refused = []
    for n in (1, 3):
        try:
            eng.start_resize(n)
        except ResizeError as e:
            refused.append(str(e))
    eng.add_request("a", [5, 6, 7], greedy(6))
    got = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            got = out.outputs[0].token_ids if out.finished else got
    eng.shutdown()
    return {"refused": refused, "got": got}


@pytest.mark.multirank
def test_disaggregated_deployments_refuse_a_resize_and_serve_on(tiny):
    front, _ = spawn(_disagg, 2, args=(tiny,), timeout_s=120)
    assert len(front["refused"]) == 2 and all("disaggregated deployment" in r for r in front["refused"]), front
    assert len(front["got"]) == 6
