"""The per-step sync gives every rank the step's largest token count, and the engine hands it to a
dispatcher that picks its mode per step (DeepEP: low-latency when the step is small) — the same
value on every rank, or the ranks would enter different collectives."""
from __future__ import annotations

import pytest

from tests.parallel.spawn import spawn


def _sync(n: int) -> int:
    from engine.spmd import StepSync
    from parallel import ParallelConfig, bootstrap, shutdown
    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2))
    s = StepSync(ctx)
    s.sync(True, num_tokens=n + 5 * ctx.rank)
    shutdown(ctx)
    return s.max_tokens


def _engine_plans(model_dir: str) -> list[int]:
    from engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, block_size=8, max_num_batched_tokens=256)
    planned: list[int] = []
    llm.engine.core.model.dispatcher.plan = planned.append
    # 2 prompts: rank 0 gets the 9-token one, rank 1 the 4-token one (least-loaded assignment)
    llm.generate([list(range(2, 11)), [3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    llm.shutdown()
    return planned


@pytest.mark.multirank
def test_sync_gives_every_rank_the_max_tokens():
    assert spawn(_sync, 2, args=(3,), timeout_s=60) == [8, 8]


@pytest.mark.multirank
def test_engine_plans_the_dispatcher_with_the_steps_max_tokens(tmp_path):
    from launch.tiny import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=1)
    plans = spawn(_engine_plans, 2, args=(d,), timeout_s=120)
    assert plans[0] == plans[1]
    # each step is planned before it runs and unplanned (None) after it
    assert plans[0] == [9, None, 1, None, 1, None]   # prefill: the longer prompt, on rank 0; 2 decodes
