"""`POST /scale_elastic_ep {"new_data_parallel_size": N}` on `wideep serve MODEL --dp-size 4` (ranks spawned by
serve itself) while a 64-request load streams: 4 -> 3 -> 1 ranks, every request finishes with the tokens of one
process (greedy; none lost or failed, new ones accepted throughout), each route call answers once the new shape
serves with the new size and its time, the dropped ranks' processes exit 0; bad requests are a 400 naming the
problem and the server keeps serving. The route's status codes on a stub engine (409 for a resize already running)."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.launch.runs import alive
from tests.launch.test_serve_spawn import FLAGS, LINUX, Spawned
from tests.launch.test_server import complete, request

RESIZE_LIMIT_S = 30.0


def load(n: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(48)
    return [([rng.randrange(2, 250) for _ in range(rng.randint(4, 40))], rng.randint(16, 40)) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("resize")), arch="v3", seed=4)


@pytest.fixture(scope="module")
def solo(tiny):
    """The load's tokens from one process (greedy)."""
    from wideep.engine import LLM, SamplingParams
    llm = LLM(tiny, progress=False, max_model_len=128, kv_cache_blocks=64)
    reqs = load()
    return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0.0,
                                                                                               max_tokens=n)
                                                                                for _, n in reqs])]


def scale(base: str, body) -> tuple[int, dict]:
    status, raw = request(base, "POST", "/scale_elastic_ep", body, timeout_s=90)
    return status, json.loads(raw)


def left_and_serves_on(s: Spawned, left: dict[int, int]) -> int | None:
    """The ranks a shrink dropped ({rank: pid}) exited with status 0, named by the supervisor, and are gone; the
    deployment still completes a request; then SIGTERM stops it: its exit status."""
    for rank, pid in left.items():
        assert s.saw(f"rank {rank} (pid {pid}) exited (exit status 0)", 10), s.output
        assert not alive(pid)
    assert complete(s.base, [5, 6, 7], 4, True)["finish_reason"] == "length"
    s.proc.send_signal(signal.SIGTERM)
    return s.wait(60)


def serve_under_load(s: Spawned, sizes: list[int], bad: list = ()) -> tuple[list, list, list]:
    """The 64-request load (half streamed) on s, in len(sizes) + 1 waves: the first, then each size through the
    route with the next wave sent while that resize runs; then each bad body. -> (the load's results in order,
    the route's answers, the bad bodies' answers)."""
    reqs = load()
    waves = [range(len(reqs))[i::len(sizes) + 1] for i in range(len(sizes) + 1)]
    jobs: dict[int, object] = {}
    with ThreadPoolExecutor(len(reqs) + 1) as ex:
        def send(wave):
            for i in wave:
                jobs[i] = ex.submit(complete, s.base, *reqs[i], i % 2 == 0)
        send(waves[0])
        time.sleep(1.0)   # the load is in flight
        answers = []
        for n, wave in zip(sizes, waves[1:]):
            asked = ex.submit(scale, s.base, {"new_data_parallel_size": n})
            time.sleep(0.02)
            send(wave)        # accepted while the resize runs
            answers.append(asked.result(timeout=120))
        refused = [scale(s.base, b) for b in bad]
        got = [jobs[i].result(timeout=120) for i in range(len(reqs))]
    return got, answers, refused


@LINUX
@pytest.mark.multirank
def test_shrink_4_to_3_to_1_under_load(tiny, solo):
    s = Spawned([tiny, "--dp-size", "4", *FLAGS])
    try:
        bad = [{}, {"new_data_parallel_size": "3"}, {"new_data_parallel_size": 0}, {"new_data_parallel_size": 2.5},
               [3], {"new_data_parallel_size": 1000}]
        got, answers, refused = serve_under_load(s, [3, 1], bad)
        assert [g["token_ids"] for g in got] == solo                   # none lost or failed, tokens unchanged
        for (status, body), (old, new) in zip(answers, [(4, 3), (3, 1)]):
            assert status == 200, body
            assert body["message"] == f"Scaled to {new} data parallel engines"
            assert (body["old_data_parallel_size"], body["new_data_parallel_size"]) == (old, new)
            assert 0 < body["resize_s"] < RESIZE_LIMIT_S
        print("resize times:", [b["resize_s"] for _, b in answers])
        assert answers[0][1]["left"] == [3] and answers[1][1]["left"] == [1, 2]
        assert answers[0][1]["requests_moved"] + answers[1][1]["requests_moved"] > 0   # drained ranks had work
        assert [st for st, _ in refused] == [400] * 6, refused
        assert "new_data_parallel_size" in refused[0][1]["error"]["message"]
        assert "got '3'" in refused[1][1]["error"]["message"] and "got 0" in refused[2][1]["error"]["message"]
        assert "got 2.5" in refused[3][1]["error"]["message"]
        assert "at most" in refused[5][1]["error"]["message"] or "cannot grow" in refused[5][1]["error"]["message"]
        assert request(s.base, "GET", "/is_scaling_elastic_ep") == (200, b'{"is_scaling_elastic_ep": false}')
        rc = left_and_serves_on(s, {rank: s.ranks[rank] for rank in (1, 2, 3)})   # rank 0 alone serves on
    finally:
        s.kill()
    assert rc == 0, "".join(s.output)
    assert "Traceback" not in "".join(s.output)


@LINUX
@pytest.mark.multirank
def test_grow_4_to_6_then_shrink_to_3_under_load(tiny, solo):
    """The issue's target: 4 -> 6 -> 3 ranks while the 64-request load runs; the supervisor starts the 2 new ranks,
    they load the model while the others serve, join, and receive their experts from the ranks that hold them.
    Then 3 -> 4: the new rank gets an origin rank never used before (6)."""
    s = Spawned([tiny, "--dp-size", "4", *FLAGS])
    try:
        got, answers, _ = serve_under_load(s, [6, 3, 4])
        assert [g["token_ids"] for g in got] == solo                   # none lost or failed, tokens unchanged
        (st1, grow), (st2, shrink), (st3, again) = answers
        assert st1 == 200 and st2 == 200 and st3 == 200, answers
        assert again["members"] == [0, 1, 2, 6] and again["resize_s"] < RESIZE_LIMIT_S
        assert (grow["old_data_parallel_size"], grow["new_data_parallel_size"]) == (4, 6)
        assert grow["members"] == [0, 1, 2, 3, 4, 5] and grow["new_ranks_ready_s"] <= grow["resize_s"]
        assert grow["expert_bytes_peer"] > 0 and grow["expert_bytes_checkpoint"] == 0   # from the holders
        assert (shrink["new_data_parallel_size"], shrink["members"], shrink["left"]) == (3, [0, 1, 2], [3, 4, 5])
        print("resize times (4 -> 6, 6 -> 3, 3 -> 4):", grow["resize_s"], shrink["resize_s"], again["resize_s"])
        assert grow["resize_s"] < RESIZE_LIMIT_S and shrink["resize_s"] < RESIZE_LIMIT_S
        line = next(x for x in s.output if "started rank(s) 4, 5 (pids " in x)
        pids = [s.ranks[3], *(int(p) for p in line.split("(pids ")[1].split(")")[0].split(", "))]
        rc = left_and_serves_on(s, dict(zip((3, 4, 5), pids)))   # the supervisor started 4 and 5
    finally:
        s.kill()
    assert rc == 0, "".join(s.output)
    assert "Traceback" not in "".join(s.output)


@LINUX
@pytest.mark.multirank
def test_a_grow_whose_new_rank_cannot_load_is_a_503_and_changes_nothing(tiny, tmp_path):
    """The checkpoint's weights vanish after start-up (the running ranks hold theirs): the new rank cannot load
    the model, says why, and the front fails the resize at once (503 naming it); the deployment serves on with its
    2 ranks and can still be resized."""
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(tiny, d)
    s = Spawned([str(d), "--dp-size", "2", *FLAGS])
    try:
        before = complete(s.base, [5, 6, 7], 6, False)["token_ids"]
        for f in d.glob("*.safetensors"):
            f.unlink()
        status, body = scale(s.base, {"new_data_parallel_size": 3})
        assert status == 503, body
        msg = body["error"]["message"]
        assert "rank 2 could not load the model" in msg and "serves on unchanged" in msg, msg
        assert complete(s.base, [5, 6, 7], 6, False)["token_ids"] == before
        assert s.saw("rank 2 (pid ", 10)    # the supervisor names the new rank's failed exit
        status, body = scale(s.base, {"new_data_parallel_size": 1})   # the 2 ranks it has still resize
        assert status == 200 and body["old_data_parallel_size"] == 2, body
        assert complete(s.base, [5, 6, 7], 6, False)["token_ids"] == before
        s.proc.send_signal(signal.SIGTERM)
        rc = s.wait(60)
    finally:
        s.kill()
    assert rc == 0, "".join(s.output)


@pytest.mark.multirank
def test_a_torchrun_deployment_cannot_grow_and_says_what_to_run(tiny, tmp_path):
    """Ranks a launcher started (torchrun's variables, as launch/cli/local.py sets them): growing is a 400 that
    names what to run instead, nothing changes, and the deployment serves on."""
    from tests.launch.test_server import ServerProc, write_config
    srv = ServerProc(write_config(tiny, tmp_path), ranks=2)
    try:
        status, body = scale(srv.base, {"new_data_parallel_size": 3})
        assert status == 400, body
        msg = body["error"]["message"]
        assert "cannot grow from 2 to 3 ranks" in msg and "torchrun --nproc-per-node" in msg and "--dp-size" in msg
        assert complete(srv.base, [5, 6, 7], 4, False)["finish_reason"] == "length"
        assert request(srv.base, "GET", "/is_scaling_elastic_ep") == (200, b'{"is_scaling_elastic_ep": false}')
    finally:
        rcs = srv.stop(every_rank=False)
    assert rcs == [0, 0], srv.output


class _StubEngine:
    """AsyncEngine's resize surface: scale_elastic_ep raises `error` or answers the figures."""

    def __init__(self, error=None):
        self.error, self.asked = error, []

    async def scale_elastic_ep(self, n):
        self.asked.append(n)
        if self.error is not None:
            raise self.error
        return {"old_data_parallel_size": 2, "new_data_parallel_size": n, "resize_s": 0.1}

    is_resizing = True


@pytest.mark.parametrize("error, status", [(None, 200), ("conflict", 409), ("refused", 400), ("dead", 503)])
def test_route_status_codes(error, status):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from wideep.engine.front.async_engine import EngineDeadError
    from wideep.engine.front.resize import ResizeConflict, ResizeError
    from wideep.launch.server import resize_api
    err = {None: None, "conflict": ResizeConflict("a resize is already running"),
           "refused": ResizeError("cannot grow"), "dead": EngineDeadError("engine stopped")}[error]
    stub = _StubEngine(err)

    async def go():
        app = web.Application()
        app.add_routes(resize_api.routes(stub))
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
            body = await r.json()
            r2 = await client.get("/is_scaling_elastic_ep")
            return r.status, body, await r2.json()
    got, body, scaling = asyncio.run(go())
    assert got == status, body
    assert stub.asked == [3] and scaling == {"is_scaling_elastic_ep": True}
    if status == 200:
        assert body["message"] == "Scaled to 3 data parallel engines" and body["new_data_parallel_size"] == 3
    else:
        assert body["error"]["code"] == status and str(err) in body["error"]["message"]


def test_scale_route_needs_the_api_key():
    from wideep.launch.server.api_key import ApiKey
    assert ApiKey("k").guards("/scale_elastic_ep") and not ApiKey("k").guards("/is_scaling_elastic_ep")



def test_a_launcher_that_cannot_start_ranks_is_a_clear_error():
    """The supervisor's end answers a refusal (or is gone): rank 0's Spawner raises SpawnError with the reason,
    which the engine turns into a 400 naming it (Engine.start_resize: "the launcher could not start ranks")."""
    import threading

    from wideep.launch.cli.spawn_link import SpawnError, Spawner, SupervisorEnd
    sup = SupervisorEnd(most=4)
    w, r, most = (int(x) for x in sup.env()["WIDEEP_SPAWNER"].split(","))
    spawner = Spawner(w, r, most)
    assert most == 4 and Spawner.from_env({}) is None

    def supervisor():
        req = sup.poll(10)
        sup.answer({"error": f"could not start a process: asked {req['start']} for world {req['world']}"})
    t = threading.Thread(target=supervisor)
    t.start()
    with pytest.raises(SpawnError, match=r"could not start a process: asked \[2, 3\] for world 4"):
        spawner.start([2, 3], 4, {"WIDEEP_JOIN": "x"})
    t.join()
    sup.close()   # the supervisor is gone: the next ask fails at once, naming it
    with pytest.raises(SpawnError, match="the supervisor that started this deployment is gone"):
        spawner.start([2], 3, {})
