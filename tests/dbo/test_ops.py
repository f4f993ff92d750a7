"""The model's one forward (its operation list) and the typed state between its operations: a
plain step and a split step run the same list and agree; a stage that reads a value its own
microbatch never set (another microbatch's, or an earlier layer's), overwrites one, or leaves one
behind at the end of a layer fails, naming it."""
from __future__ import annotations

import pytest
import torch

from wideep.dbo.schedule import YIELD, run_overlapped, run_sequential
from wideep.dbo.state import Microbatch, OpState, OpStateError
from wideep.parallel import StepPlan


def _state(index: int, **values) -> OpState:
    return OpState(Microbatch(index, None, None, [], StepPlan(), None), **values)


def test_a_stage_reading_what_another_microbatch_wrote_fails():
    # stage "a" writes only for microbatch 0 (a bug); with a dict shared across microbatches, or a
    # value left over, microbatch 1's "b" would silently read microbatch 0's value
    def a(s):
        if s.inputs.index == 0:
            s.put(k=1)

    def b(s):
        s.put(out=s.take("k"))
    with pytest.raises(OpStateError, match=r"microbatch 1: 'k' was not set by this microbatch's earlier operations"):
        run_overlapped([a, YIELD, b], [_state(0), _state(1)])


def test_one_state_for_two_microbatches_is_refused():
    s = _state(0)
    with pytest.raises(ValueError, match="each microbatch needs its own state object"):
        run_overlapped([lambda s: None], [s, s])


def test_overwrite_and_leftovers_fail():
    s = _state(3, x=1)
    with pytest.raises(OpStateError, match=r"microbatch 3: 'x' is set again before anything took it"):
        s.put(x=2)
    s.put(h=2)
    with pytest.raises(OpStateError, match=r"microbatch 3: layer 5 ended with \['h'\] set and never taken"):
        s.end_layer(5, carry=("x",))
    assert s.take("h") == 2 and s.peek("x") == 1
    s.end_layer(5, carry=("x",))
    with pytest.raises(OpStateError, match=r"layer 6 ended without \['rope'\]"):
        s.end_layer(6, carry=("x", "rope"))
    s.put(y=0)
    with pytest.raises(OpStateError, match=r"the operations ended with \['y'\] set and never taken"):
        s.result("x")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("ops")), arch="v3", seed=6, initializer_range=0.2)


def test_a_stray_value_in_the_models_operations_is_reported_at_the_layer_end(model_dir):
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, block_size=8)
    model = llm.model
    ops = list(model.step_ops)
    layer = model.model.layers[1]
    ops.insert(ops.index(layer.op_attention) + 1, lambda s: s.put(scratch=0))
    runner, kv = llm.engine.core.runner, llm.engine.core.kv
    from wideep.engine.sched.scheduler import ScheduledBatch
    from wideep.engine.worker.messages import NewRequest
    seq = llm.engine.core.make_sequence(NewRequest("a", [3, 4, 5], SamplingParams(max_tokens=1), 1, 0.0))
    seq.block_ids = [0]
    ids, meta = runner.build_meta(ScheduledBatch([seq], [3]))
    s = OpState(Microbatch(0, ids, meta, kv.pools, StepPlan(3), model.dispatcher))
    with pytest.raises(OpStateError, match=r"microbatch 0: layer 1 ended with \['scratch'\] set and never taken"):
        run_sequential(ops, s)
    def run(op_list):
        return run_sequential(op_list, OpState(Microbatch(0, ids, meta, kv.pools, StepPlan(3),
                                                          model.dispatcher))).result("hidden")
    # forward runs the decode plan's operations (a small prefill: every query on the paged kernel, the whole step
    # one C call, with its own kernel for the shared experts' SiLU: equal to float32 rounding)
    plan_ops = model.decode_plan.ops_for(s.inputs)
    assert model.backends["decode"] == "stack"
    assert torch.equal(run(plan_ops), model(ids, meta, kv.pools, StepPlan(3)))
    torch.testing.assert_close(run(model.step_ops), run(plan_ops), rtol=1e-5, atol=1e-5)


def test_split_step_equals_plain_step_on_one_rank(model_dir):
    """One process: the split step runs the same operation list over the one-rank dispatcher."""
    from wideep.engine import LLM, SamplingParams
    prompts = [[3 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([37, 5, 1, 23])]
    sp = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    res = {}
    for dbo in (False, True):
        llm = LLM(model_dir, progress=False, block_size=8, max_num_batched_tokens=64, dbo=dbo)
        outs = llm.generate(prompts, sp)
        res[dbo] = [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
                    for o in outs]
        if dbo:
            assert llm.engine.core.split_steps > 0
            assert type(llm.model.dispatcher).__name__ == "LocalDispatcher"
    for (tok_off, lp_off), (tok_on, lp_on) in zip(res[False], res[True]):
        assert tok_on == tok_off
        if lp_off:
            assert (torch.tensor(lp_on) - torch.tensor(lp_off)).abs().max() <= 1e-5
