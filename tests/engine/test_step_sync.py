"""The per-step sync returns one StepPlan, the same on every rank (the largest token count of any
rank, the split decision, the dispatch mode from the dispatcher's low-latency limit), and the
engine passes that plan down to every dispatch of the step — the ranks would otherwise enter
different collectives. There is no dispatcher state to set or reset between steps."""
from __future__ import annotations

import pytest

from tests.parallel.spawn import spawn


def _sync(n: int) -> list:
    from wideep.engine.worker.step_sync import StepSync
    from wideep.parallel import ParallelConfig, bootstrap, shutdown
    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2))
    s = StepSync(ctx, low_latency_max_tokens=8)
    res = [s.sync(True, num_tokens=n + 5 * ctx.rank),                       # max 8: low-latency
           s.sync(ctx.rank == 1, num_tokens=n + 1 + 5 * ctx.rank),           # max 9: normal mode
           s.sync(False, can_split=True, vote=True),                         # nobody has work
           s.sync(True, can_split=True, vote=ctx.rank == 0, num_tokens=2),   # rank 0's vote counts
           s.sync(False, command=(3 * 4 + 1) if ctx.rank == 1 else 0),       # one rank's command (#3, END)
           s.sync(True, num_tokens=1, draft_passes=3 if ctx.rank else 1)]    # the MTP drafter's passes: the most
    shutdown(ctx)
    return [(r.any_work, r.plan, r.command, r.command_seq) for r in res] + [(s.calls, s.bytes)]


def _engine_plans(model_dir: str) -> dict:
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, block_size=8, max_num_batched_tokens=256)
    core = llm.engine.core
    steps, dispatched = [], []
    execute, dummy, start = core.runner.execute, core.runner.dummy_step, core.model.dispatcher.dispatch_start

    def spy_execute(batch, plan, **kw):
        steps.append(plan)
        return execute(batch, plan, **kw)

    def spy_dummy(plan):      # a rank whose request has not arrived yet still enters every all-to-all
        steps.append(plan)
        return dummy(plan)

    def spy_start(x, ids, w, plan):
        dispatched.append(plan)
        return start(x, ids, w, plan)
    core.runner.execute, core.runner.dummy_step, core.model.dispatcher.dispatch_start = spy_execute, spy_dummy, spy_start
    # 2 prompts: rank 0 gets the 9-token one, rank 1 the 4-token one (least-loaded assignment)
    llm.generate([list(range(2, 11)), [3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    moe_layers = len(core.model.moe_layers())
    llm.shutdown()
    return {"steps": steps, "every_dispatch_got_its_step_plan":
            len(dispatched) == len(steps) * moe_layers
            and all(p is steps[i // moe_layers] for i, p in enumerate(dispatched))}


@pytest.mark.multirank
def test_sync_gives_every_rank_the_same_plan():
    from wideep.parallel import StepPlan
    for plans in spawn(_sync, 2, args=(3,), timeout_s=60):
        assert plans == [(True, StepPlan(8, False, True), 0, 0), (True, StepPlan(9, False, False), 0, 0),
                         (False, StepPlan(), 0, 0), (True, StepPlan(2, True, True), 0, 0),
                         (False, StepPlan(), 1, 3), (True, StepPlan(1, False, True, 3), 0, 0),
                         (6, 6 * 6 * 8)]   # six all-reduces of six int64s: 48 bytes a step, any batch


@pytest.mark.multirank
def test_engine_passes_the_steps_plan_to_every_dispatch(tmp_path):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    from wideep.parallel import StepPlan
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=1)
    ranks = spawn(_engine_plans, 2, args=(d,), timeout_s=120)
    assert ranks[0]["steps"] == ranks[1]["steps"]
    # the prefills (9 tokens on rank 0, 4 on rank 1; they may land in different steps, as each rank
    # gets its request), then decodes; the torch dispatcher's default limit
    # (torch_low_latency_max_tokens = 64) makes every step low-latency
    plans = ranks[0]["steps"]
    assert plans[0] in (StepPlan(9, False, True), StepPlan(4, False, True))
    assert StepPlan(9, False, True) in plans and plans[-1] == StepPlan(1, False, True)
    assert all(p.low_latency and not p.split for p in plans)
    assert all(r["every_dispatch_got_its_step_plan"] for r in ranks)
