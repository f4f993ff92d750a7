"""Serving through a lost rank (on_rank_loss = "continue"): 4 ranks with redundant expert slots, a
rank SIGKILLed mid-generation; every request finishes with exactly the tokens of a run without the
failure (greedy and seeded sampling), no KV block leaks on the survivors, the experts only the lost
rank held come back (from the checkpoint), a second loss is survived too, and the front's metrics
count it all. DeepSeek-V4 too (its experts under its own tensor names)."""
from __future__ import annotations

import random

import pytest

from tests.engine.test_engine import greedy
from tests.faults import sigkill_at_step
from tests.parallel.spawn import run, spawn

TIMEOUT_S = 30.0
PARALLEL = {"on_rank_loss": "continue", "num_redundant_experts": 4, "timeout_s": TIMEOUT_S, "heartbeat_s": 0.5}


def requests(n: int = 40, vocab: int = 250) -> list[dict]:
    rng = random.Random(11)
    out = []
    for i in range(n):
        seeded = i % 5 == 4
        out.append(dict(id=f"q{i}", prompt=[rng.randrange(2, vocab) for _ in range(rng.randint(3, 40))],
                        max_tokens=rng.randint(8, 30), arrival=rng.randint(0, 10), seed=1000 + i if seeded else None))
    return out


def _params(r: dict):
    from wideep.engine import SamplingParams
    if r["seed"] is None:
        return greedy(r["max_tokens"])
    return SamplingParams(temperature=0.8, top_k=20, seed=r["seed"], max_tokens=r["max_tokens"], ignore_eos=True)


def _serve(model_dir: str, victims: dict, options: dict | None = None, vocab: int = 250) -> dict:
    """Every rank (or one process, with no RANK); victims: origin rank -> the model step at which it is killed.
    options: engine options over the defaults below."""
    import os

    from wideep.engine.front.engine import Engine
    rank = int(os.environ.get("RANK", 0))
    if rank in victims:
        sigkill_at_step(victims[rank])
    opts = dict(progress=False, block_size=8, kv_cache_blocks=96, max_num_seqs=16, max_num_batched_tokens=96,
                parallel=PARALLEL if "RANK" in os.environ else {})
    eng = Engine(model_dir, **dict(opts, **(options or {})))
    if not eng.is_front:
        how = eng.run_worker_loop()
        b = eng.core.blocks
        return {"how": how, "free": b.num_free, "total": b.num_blocks, "world": eng.ctx.world_size}
    reqs = requests(vocab=vocab)
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
    return {"got": done, "free": b.num_free, "total": b.num_blocks, "world": eng.ctx.world_size,
            "rank_losses": m.get("rank_losses"), "readmitted": m.get("requests_readmitted"),
            "recoveries": m.get("recoveries")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
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
@pytest.mark.parametrize("layers", ["flash", "pro"])
def test_a_lost_rank_loses_no_request_deepseek_v4(tmp_path, layers):
    """DeepSeek-V4 (Flash- and Pro-shaped layer orders, hash-routed layers), 4 ranks, one SIGKILLed mid-generation:
    the survivors finish every request with the tokens of one process, and the experts only the lost rank held come
    back from the checkpoint under V4's tensor names."""
    pytest.importorskip("transformers")
    from tests.oracle_v4 import make_v4_model
    from wideep.launch.tiny.v4 import FLASH, PRO
    d = str(tmp_path / "v4")
    make_v4_model(d, layer_types=FLASH if layers == "flash" else PRO)
    options = dict(kv_cache_blocks=None, kv_cache_memory=64 << 20)
    alone = _serve(d, {}, options, vocab=190)["got"]
    outs = run(_serve, 4, args=(d, {2: 10}, options, 190), timeout_s=400)
    assert outs[2].returncode == -9, outs[2].stderr[-2000:]
    for o in (outs[0], outs[1], outs[3]):
        assert o.ok, o.stderr[-4000:]
    front = outs[0].value
    assert front["got"] == alone                     # all 40, token for token (greedy and seeded)
    (rec,) = front["recoveries"]
    assert rec["lost"] == [2] and rec["members"] == [0, 1, 3]
    assert rec["expert_bytes_checkpoint"] > 0        # experts only rank 2 held came back from the files
    for o in (outs[0], outs[1], outs[3]):
        assert o.value["free"] == o.value["total"], "a survivor leaked KV blocks"


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


def _serve_eplb(model_dir: str, victim: int, kill_step: int) -> dict:
    """EPLB on, rebalancing every 6 steps with one layer staged per step: the victim dies while a
    weight transfer is in flight; the survivors drop it and re-plan from the committed placement."""
    import os

    import wideep.eplb.rebalancer as rebalancer
    from wideep.engine.front.engine import Engine
    rank = int(os.environ["RANK"])
    staged = {"n": 0}
    stage = rebalancer.Rebalance.stage

    def counting_stage(self, num_layers=None):
        staged["n"] += 1
        if rank == victim and staged["n"] == kill_step:
            os.kill(os.getpid(), 9)        # in the middle of a rebalance: its first layer is staged
        return stage(self, num_layers)
    rebalancer.Rebalance.stage = counting_stage
    eng = Engine(model_dir, progress=False, block_size=8, kv_cache_blocks=96, max_num_seqs=16,
                 max_num_batched_tokens=96, parallel=PARALLEL,
                 eplb={"enabled": True, "step_interval": 6, "window_size": 6, "transfer_layers_per_step": 1})
    if not eng.is_front:
        eng.run_worker_loop()
        return {"staged": staged["n"]}
    for r in requests(24):
        eng.add_request(r["id"], r["prompt"], _params(r))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    m = eng.metrics()
    eng.shutdown()
    return {"got": done, "rank_losses": m["rank_losses"]}


@pytest.mark.multirank
@pytest.mark.slow
def test_a_loss_during_an_eplb_weight_transfer(setup):
    d, _ = setup
    ref = spawn(_serve_eplb, 4, args=(d, -1, 0), timeout_s=300)[0]["got"]
    outs = run(_serve_eplb, 4, args=(d, 3, 2), timeout_s=400)
    assert outs[3].returncode == -9, outs[3].stderr[-2000:]
    for o in outs[:3]:
        assert o.ok, o.stderr[-4000:]
    assert outs[0].value["got"] == ref and outs[0].value["rank_losses"] == 1


def _serve_without_checkpoint(model_dir: str) -> None:
    """Rank 2 dies after the checkpoint files are gone: experts only it held can come from nowhere."""
    import glob
    import os

    from wideep.engine.front.engine import Engine
    rank = int(os.environ["RANK"])
    eng = Engine(model_dir, progress=False, block_size=8, parallel=PARALLEL)
    if rank == 2:
        sigkill_at_step(4)
    if rank == 0:
        for f in glob.glob(os.path.join(model_dir, "*.safetensors")):
            os.remove(f)
    if not eng.is_front:
        eng.run_worker_loop()
        return
    for r in requests(8):
        eng.add_request(r["id"], r["prompt"], greedy(40))
    while eng.has_unfinished_requests():
        eng.step()


@pytest.mark.multirank
@pytest.mark.slow
def test_an_expert_with_no_replica_and_no_checkpoint_is_a_clear_error(tmp_path):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path / "gone"), arch="v3", seed=5, initializer_range=0.3)
    outs = run(_serve_without_checkpoint, 4, args=(d,), timeout_s=300)
    assert outs[2].returncode == -9
    for o in (outs[0], outs[1], outs[3]):
        assert o.returncode not in (0, None), o.stderr[-3000:]
        assert "have no surviving replica" in o.stderr and "could not supply them" in o.stderr, o.stderr[-3000:]


def _front_dies(model_dir: str) -> None:
    import os

    from wideep.engine.front.engine import Engine
    if int(os.environ["RANK"]) == 0:
        sigkill_at_step(5)
    eng = Engine(model_dir, progress=False, block_size=8, parallel=PARALLEL)
    if not eng.is_front:
        eng.run_worker_loop()
        raise AssertionError("a worker went on without the front")
    for r in requests(8):
        eng.add_request(r["id"], r["prompt"], greedy(40))
    while eng.has_unfinished_requests():
        eng.step()


@pytest.mark.multirank
@pytest.mark.slow
def test_the_fronts_loss_is_a_clear_exit_on_every_rank(setup):
    d, _ = setup
    outs = run(_front_dies, 4, args=(d,), timeout_s=300)
    assert outs[0].returncode == -9
    for o in outs[1:]:
        assert o.returncode not in (0, None)
        assert "rank 0 lost" in o.stderr and "the front is lost" in o.stderr, o.stderr[-3000:]
        assert o.elapsed_s - outs[0].elapsed_s < TIMEOUT_S
