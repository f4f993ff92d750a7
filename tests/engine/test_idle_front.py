"""A bare multi-rank Engine whose front stays idle longer than the collective timeout: the workers
wait for it (on the store doorbell, not inside a broadcast that would time out) and serve the next
request; a front that dies while idle stops the workers with an error naming it."""
from __future__ import annotations

import os
import time

import pytest

from tests.parallel.spawn import run, spawn

TIMEOUT_S = 6.0


def _serve_after_idle(model_dir: str, idle_s: float) -> list | str:
    from wideep.engine import SamplingParams
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, progress=False, block_size=8, parallel={"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5})
    if not eng.is_front:
        return eng.run_worker_loop()
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = []
    for rid in ("before", "after"):
        eng.add_request(rid, [3, 4, 5], sp)
        while eng.has_unfinished_requests():
            got += [o.outputs[0].token_ids for o in eng.step() if o.finished]
        if rid == "before":
            time.sleep(idle_s)       # longer than timeout_s: no step, no broadcast
    eng.shutdown()
    return got


def _front_dies_while_idle(model_dir: str) -> None:
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, progress=False, block_size=8, parallel={"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5})
    if eng.is_front:
        time.sleep(1.0)
        os._exit(3)
    eng.run_worker_loop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("idle")), arch="v3", seed=2)


@pytest.mark.multirank
def test_workers_outlast_an_idle_front(model_dir):
    front, worker = spawn(_serve_after_idle, 2, args=(model_dir, TIMEOUT_S * 1.5), timeout_s=90)
    assert front[0] == front[1] and len(front[0]) == 4
    assert worker == "shutdown"


@pytest.mark.multirank
def test_front_dying_while_idle_stops_the_workers(model_dir):
    front, worker = run(_front_dies_while_idle, 2, args=(model_dir,), timeout_s=60)
    assert front.returncode == 3
    assert worker.returncode not in (0, None) and "rank 0 lost" in worker.stderr, worker.stderr[-2000:]
    assert worker.elapsed_s - front.elapsed_s < TIMEOUT_S + 5
