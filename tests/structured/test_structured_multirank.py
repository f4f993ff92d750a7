"""Structured outputs on 4 DP ranks (gloo): constrained and free requests on different ranks give
what one process gives; only the ranks that own constrained requests ever built a matcher (nothing
about constraints crosses ranks)."""
from __future__ import annotations

import pytest

from tests.parallel.spawn import spawn
from tests.request_runs import run_in_one_process, run_on_front

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "y", "z"]}}, "required": ["id", "tag"]}


def requests() -> list[tuple[str, list[int], dict]]:
    """Equal costs, so least-loaded routing sends request i to rank i % 4: constrained ones (even i)
    to ranks 0 and 2, free ones to ranks 1 and 3."""
    out = []
    for i in range(8):
        kw = dict(max_tokens=48, temperature=0.0 if i % 4 < 2 else 1.0, seed=i)
        if i % 2 == 0:
            kw["structured_outputs"] = ({"json": SCHEMA, "disable_any_whitespace": True} if i % 4 == 0
                                        else {"regex": "[a-f]{3}-[0-9]{2,5}"})
        else:
            kw["ignore_eos"] = True
        out.append((f"r{i}", [3 + i, 40, 7 * i + 1, 9], kw))
    return out


def _rank(model_dir: str) -> dict:
    from wideep.engine.front.engine import Engine
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=32, parallel={"timeout_s": 60.0})
    if eng.ctx.rank != 0:
        how = eng.run_worker_loop()
        proc = eng.core.runner.logits_proc
        return {"how": how, "matchers": proc is not None and proc.grammar_rows is not None}
    ranks = {}
    got = {rid: (c.token_ids, c.finish_reason) for rid, c in run_on_front(eng, requests(), ranks).items()}
    proc = eng.core.runner.logits_proc
    eng.shutdown()
    return {"got": got, "ranks": ranks, "matchers": proc is not None and proc.grammar_rows is not None}


@pytest.mark.multirank
def test_four_ranks_equal_one_process(tmp_path):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=5, initializer_range=0.3)
    reqs = requests()
    want = {rid: (c.token_ids, c.finish_reason)
            for rid, c in run_in_one_process(d, reqs, block_size=16, kv_cache_blocks=64).items()}
    assert all(want[rid][1] == "stop" for rid, _, kw in reqs if "structured_outputs" in kw)
    results = spawn(_rank, 4, args=(d,), timeout_s=400)
    front = results[0]
    assert front["ranks"] == {f"r{i}": i % 4 for i in range(8)}
    assert front["got"] == want
    assert [r.get("how") for r in results[1:]] == ["shutdown"] * 3
    assert [r["matchers"] for r in results] == [True, False, True, False]


DISAGG = {"prefill": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 32},
          "decode": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 32}}


def _disagg_rank(model_dir: str) -> dict | None:
    from wideep.disagg import make_engine
    eng = make_engine(model_dir, DISAGG, progress=False, block_size=16, parallel={"timeout_s": 60.0})
    if not eng.is_front:
        eng.run_worker_loop()
        return None
    got = {rid: (c.token_ids, c.finish_reason) for rid, c in run_on_front(eng, requests()).items()}
    eng.shutdown()
    return got


@pytest.mark.multirank
def test_disaggregated_prefill_then_decode_equals_one_process(tmp_path):
    """The prefill pool samples the first token under the grammar; the decode pool's matcher replays
    it and goes on: the outputs are one process's."""
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=5, initializer_range=0.3)
    want = {rid: (c.token_ids, c.finish_reason)
            for rid, c in run_in_one_process(d, requests(), block_size=16, kv_cache_blocks=64).items()}
    got = spawn(_disagg_rank, 2, args=(d,), timeout_s=400)[0]
    assert got == want
