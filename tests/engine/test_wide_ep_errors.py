"""Wide EP failure modes: bad sizes and mismatched configs fail on every rank with one clear
error; a rank killed mid-generation makes every other rank exit non-zero, naming it, in time."""
from __future__ import annotations

import os
import signal

import pytest

from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.faults import sigkill_at_step
from tests.parallel.spawn import run

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ep_err")), arch="v3", seed=3)


def _build(model_dir: str, kwargs_by_rank: dict) -> str:
    from wideep.engine import LLM
    rank = int(os.environ["RANK"])
    llm = LLM(model_dir, progress=False, parallel={"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5},
              **kwargs_by_rank.get(rank, kwargs_by_rank.get("all", {})))
    llm.shutdown()
    return "built"


def _errors(outs) -> list[str]:
    return [o.error or o.stderr for o in outs]


@pytest.mark.multirank
def test_experts_not_divisible_by_ep_fails_on_every_rank(tiny):
    outs = run(_build, 3, args=(tiny, {}), timeout_s=90)  # 16 experts on 3 ranks
    for e in _errors(outs):
        assert "n_routed_experts + num_redundant_experts (16) is not divisible by ep_size (3)" in e


@pytest.mark.multirank
def test_size_mismatch_and_config_mismatch_fail_on_every_rank(tiny):
    outs = run(_build, 2, args=(tiny, {"all": {"dp_size": 4, "ep_size": 4}}), timeout_s=90)
    for e in _errors(outs):
        assert "dp_size (4) != world_size (2)" in e
    outs = run(_build, 2, args=(tiny, {1: {"max_num_seqs": 7}}), timeout_s=90)  # rank 1 differs
    for o, e in zip(outs, _errors(outs)):
        assert o.returncode != 0 and "config mismatch: ranks [1]" in e, e


def _generate_until_killed(model_dir: str, victim: int) -> None:
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, parallel={"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5})
    if llm.ctx.rank == victim:
        sigkill_at_step(3)
    llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    raise AssertionError("generation finished although a rank was killed")


@pytest.mark.multirank
def test_rank_killed_mid_generation_stops_everyone(tiny):
    victim = 1
    outs = run(_generate_until_killed, 4, args=(tiny, victim), timeout_s=TIMEOUT_S + 60)
    assert outs[victim].returncode == -signal.SIGKILL
    for o in outs:
        if o.rank == victim:
            continue
        assert o.returncode not in (0, None), o.stderr[-2000:]
        assert f"rank {victim} lost" in o.stderr, o.stderr[-2000:]
        assert o.elapsed_s - outs[victim].elapsed_s < TIMEOUT_S
