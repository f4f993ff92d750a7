"""1 prefill + 1 decode rank: the latent KV a decode rank receives equals what it computes itself
for the same prompt (chunked prefills and prefix-cache hits on the prefill rank included); bad
requests get a clear error at the front, which keeps serving; aborts before and after the transfer
completes finish the request and free its blocks."""
from __future__ import annotations

import random

import pytest

from tests.disagg import prefill_hits
from tests.engine.test_engine import alone, drive, greedy
from tests.parallel.spawn import spawn

POOLS = {"prefill": {"dp_size": 1, "ep_size": 1, "max_num_batched_tokens": 32, "kv_cache_blocks": 20},
         "decode": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 40}}


def requests() -> list[dict]:
    rng = random.Random(3)
    system = [rng.randrange(2, 250) for _ in range(40)]  # 2 full blocks shared: prefix hits on the prefill rank
    reqs = [dict(id=f"s{i}", prompt=system + [rng.randrange(2, 250) for _ in range(5 + 7 * i)], max_tokens=6,
                 arrival=6 * i) for i in range(4)]
    reqs.append(dict(id="chunked", prompt=[rng.randrange(2, 250) for _ in range(100)], max_tokens=5, arrival=1))
    reqs += [dict(id=f"r{i}", prompt=[rng.randrange(2, 250) for _ in range(rng.randint(1, 30))],
                  max_tokens=rng.randint(1, 6), arrival=rng.randint(0, 20)) for i in range(6)]
    return reqs


def _rank(model_dir: str) -> dict | str:
    from wideep.attention_mla.kv_cache import gather_reference
    from wideep.engine.model.mla_cache import LatentCache
    from wideep.disagg import make_engine
    from wideep.engine.worker.messages import NewRequest
    from wideep.engine.worker.runner import ModelRunner
    from wideep.engine.sched.scheduler import ScheduledBatch
    from wideep.parallel import StepPlan
    eng = make_engine(model_dir, POOLS, progress=False, block_size=16, parallel={"timeout_s": 60.0})
    if not eng.is_front:
        return eng.run_worker_loop()
    core, bs = eng.core, 16
    received, finish = {}, eng.receiver._finish

    def spy(inc, trailer):
        n = len(inc.seq.prompt_token_ids)
        received[inc.seq.request_id] = [gather_reference(p, inc.seq.block_ids, n, bs).clone() for p in core.kv.pools]
        finish(inc, trailer)
    eng.receiver._finish = spy

    errors = []
    for rid, prompt, params in [("too_long", [i % 250 + 2 for i in range(400)], greedy(1)),  # 25 blocks > the prefill's 20
                                ("empty", [], greedy(1)), ("vocab", [3, 4000], greedy(1))]:
        try:
            eng.add_request(rid, prompt, params)
        except ValueError as e:
            errors.append(str(e))
    reqs = requests()
    got = drive(eng, reqs)
    try:
        eng.add_request("dup", [5], greedy(1))
        eng.add_request("dup", [5], greedy(1))
    except ValueError as e:
        errors.append(str(e))
    while eng.has_unfinished_requests():
        eng.step()
    # aborts: one right away (its KV still on the way), one while it decodes
    reasons = {}
    eng.add_request("abort_early", list(range(2, 60)), greedy(50))
    eng.add_request("abort_late", list(range(3, 40)), greedy(50))
    eng.abort("abort_early")
    steps, late_aborted = 0, False
    while eng.has_unfinished_requests():
        outs = eng.step()
        finished = {o.request_id for o in outs if o.finished}
        for o in outs:
            if o.finished:
                reasons[o.request_id] = (o.outputs[0].finish_reason, len(o.outputs[0].token_ids))
            elif (o.request_id == "abort_late" and not late_aborted and "abort_late" not in finished
                  and len(o.outputs[0].token_ids) >= 3):
                eng.abort("abort_late")   # once: a second abort of a finished request is an error
                late_aborted = True
        steps += 1
        assert steps < 2000
    # the decode rank computes each prompt itself, into a scratch cache, and compares
    diffs, scale = {}, {}
    for r in reqs + [dict(id="dup", prompt=[5])]:
        n = len(r["prompt"])
        kv = LatentCache(len(core.kv.pools), -(-n // bs), bs, core.kv.latent_dim, core.model.dtype)
        seq = core.make_sequence(NewRequest(r["id"], r["prompt"], greedy(1), 1, 0.0))
        seq.block_ids = list(range(kv.num_blocks))
        ModelRunner(core.model, kv).execute(ScheduledBatch([seq], [n]), StepPlan(n))  # alone: a 1-rank pool
        mine = [gather_reference(p, seq.block_ids, n, bs) for p in kv.pools]
        diffs[r["id"]] = max((a - b).abs().max().item() for a, b in zip(received[r["id"]], mine))
        scale[r["id"]] = min(a.abs().max().item() for a in mine)
    hits = prefill_hits(eng)
    eng.shutdown()
    return {"got": got, "errors": errors, "reasons": reasons, "diffs": diffs, "scale": scale, "prefill_prefix_hits": hits,
            "free": core.blocks.num_free, "total": core.blocks.allocators["latent"].num_blocks}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("disagg_kv")), arch="v3", seed=5, initializer_range=0.3)


@pytest.mark.multirank
def test_received_kv_equals_local_compute_and_bad_requests_are_rejected(model_dir):
    front, prefill = spawn(_rank, 2, args=(model_dir,), timeout_s=240)
    assert prefill == "shutdown"
    reqs = requests()
    assert front["got"] == alone(model_dir, reqs)
    assert front["prefill_prefix_hits"] > 0, "the shared prefix was meant to hit the prefill rank's cache"
    for rid, d in front["diffs"].items():
        assert d <= 1e-4 * max(1.0, front["scale"][rid]), (rid, d)
    assert min(front["scale"].values()) > 0.1  # the comparison is over real values, not zeros
    e = front["errors"]
    assert "needs 25 KV blocks on a prefill rank; its cache has 20" in e[0]
    assert "prompt is empty" in e[1] and "prompt token id 4000 is out of range" in e[2]
    assert "duplicate request id 'dup'" in e[3]
    assert front["reasons"]["abort_early"][0] == "abort" and front["reasons"]["abort_late"][0] == "abort"
    assert 3 <= front["reasons"]["abort_late"][1] < 50
    assert front["free"] == front["total"]
