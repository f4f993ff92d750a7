"""Serving through a lost rank (on_rank_loss = "continue"): 4 ranks with redundant expert slots, a
rank SIGKILLed mid-generation; every request finishes with exactly the tokens of a run without the
failure (greedy and seeded sampling), no KV block leaks on the survivors, the experts only the lost
rank held come back (from the checkpoint), a second loss is survived too, and the front's metrics
count it all."""
from __future__ import annotations

import random

import pytest

from tests.engine.test_engine import greedy
from tests.faults import sigkill_at_step
from tests.parallel.spawn import run, spawn

TIMEOUT_S = 30.0
PARALLEL = {"on_rank_loss": "continue", "num_redundant_experts": 4, "timeout_s": TIMEOUT_S, "heartbeat_s": 0.5}


def requests(n: int = 40) -> list[dict]:
    rng = random.Random(11)
    out = []
    for i in range(n):
        seeded = i % 5 == 4
        out.append(dict(id=f"q{i}", prompt=[rng.randrange(2, 250) for _ in range(rng.randint(3, 40))],
                        max_tokens=rng.randint(8, 30), arrival=rng.randint(0, 10), seed=1000 + i if seeded else None))
    return out


def _params(r: dict):
    from engine import SamplingParams
    if r["seed"] is None:
        return greedy(r["max_tokens"])
    return SamplingParams(temperature=0.8, top_k=20, seed=r["seed"], max_tokens=r["max_tokens"], ignore_eos=True)


def _serve(model_dir: str, victims: dict) -> dict:
    """Every rank; victims: origin rank -> the model step at which it is killed."""
    import os

    from engine.engine import Engine
    rank = int(os.environ["RANK"])
    if rank in victims:
        sigkill_at_step(victims[rank])
    eng = Engine(model_dir, progress=False, block_size=8, kv_cache_blocks=96, max_num_seqs=16,
                 max_num_batched_tokens=96, parallel=PARALLEL)
    if not eng.is_front:
        how = eng.run_worker_loop()
        b = eng.core.blocks
        return {"how": how, "free": b.num_free, "total": b.allocator.num_blocks, "world": eng.ctx.world_size}
    reqs = requests()
    by_step: dict[int, list] = {}
    for r in reqs:
        by_step.setdefault(r["arrival"], []).append(r)
    done, step = {}, 0
    while step <= max(by_step) or eng.has_unfinished_requests():
        for r in by_step.get(step, []):
            eng.add_request(r["id"], r["prompt"], _params(r))
        for out in eng.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        step += 1
        assert step < 20000
    m = eng.metrics()
    eng.shutdown()
    b = eng.core.blocks
    return {"got": done, "free": b.num_free, "total": b.allocator.num_blocks, "world": eng.ctx.world_size,
            "rank_losses": m["rank_losses"], "readmitted": m["requests_readmitted"], "recoveries": m["recoveries"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from launch.tiny import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("elastic")), arch="v3", seed=5, initializer_range=0.3)
    reference = spawn(_serve, 4, args=(d, {}), timeout_s=300)[0]["got"]
    return d, reference


@pytest.mark.multirank
@pytest.mark.slow
def test_a_lost_rank_loses_no_request(setup):
    d, reference = setup
    outs = run(_serve, 4, args=(d, {2: 12}), timeout_s=400)
    assert outs[2].returncode == -9, outs[2].stderr[-2000:]
    for o in (outs[0], outs[1], outs[3]):
        assert o.ok, o.stderr[-4000:]
    front = outs[0].value
    assert front["got"] == reference                 # all 40, token for token (greedy and seeded)
    assert front["rank_losses"] == 1 and front["readmitted"] > 0
    (rec,) = front["recoveries"]
    assert rec["lost"] == [2] and rec["members"] == [0, 1, 3] and rec["recovery_s"] < TIMEOUT_S
    assert rec["expert_bytes_checkpoint"] > 0        # experts only rank 2 held came back from the files
    for o in (outs[0], outs[1], outs[3]):
        assert o.value["free"] == o.value["total"], "a survivor leaked KV blocks"
        assert o.value["world"] == 3


@pytest.mark.multirank
@pytest.mark.slow
def test_two_ranks_lost_one_after_the_other(setup):
    d, reference = setup
    outs = run(_serve, 4, args=(d, {1: 8, 3: 25}), timeout_s=400)
    assert outs[1].returncode == -9 and outs[3].returncode == -9
    for o in (outs[0], outs[2]):
        assert o.ok, o.stderr[-4000:]
    front = outs[0].value
    assert front["got"] == reference
    assert front["rank_losses"] == 2 and [r["members"] for r in front["recoveries"]] == [[0, 2, 3], [0, 2]]
    assert outs[2].value["free"] == outs[2].value["total"] and outs[2].value["world"] == 2
