"""A CPU decode step's decoder layers as one C call (engine/model/model.py DeepseekModel.op_layers,
cpu/fused.py decode_stack) against the same step a layer half at a time: bit-equal outputs and caches (the same C
calls), EPLB's load counts, the dispatcher's counters and routing histogram; the steps it must leave to
the layers (a per-layer hook, a prefill, a layer that cannot be fused); a bad slot named with its layer."""
from __future__ import annotations

import pytest
import torch

from cpu import fused as cl
from cpu.build import unusable
from parallel.step_plan import StepPlan

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from engine import LLM
    from launch.tiny import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("stack")), "v3", num_hidden_layers=3, first_k_dense_replace=1,
                             n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, vocab_size=200,
                             seed=3, initializer_range=0.2)
    return LLM(d, dtype="float32", device="cpu", progress=False, block_size=4, kv_cache_blocks=32, max_num_seqs=4)


def _decode_batch(llm, lens):
    """A decode step of len(lens) sequences whose contexts hold lens[b] tokens (cache rows written by a
    prefill through the model) -> (input_ids, meta)."""
    from engine.worker.messages import NewRequest
    from engine.sched.scheduler import ScheduledBatch
    from engine import SamplingParams
    core = llm.engine.core
    seqs = []
    for b, n in enumerate(lens):
        s = core.make_sequence(NewRequest(f"s{b}", [3 + (7 * b + j) % 150 for j in range(n + 1)],
                                          SamplingParams(max_tokens=1), b, 0.0))
        s.block_ids = list(range(8 * b, 8 * b + 8))
        seqs.append(s)
    ids, meta = core.runner.build_meta(ScheduledBatch(seqs, [n for n in lens]))          # the prompts' prefill
    llm.model(ids, meta, core.kv.pools, StepPlan(sum(lens)))
    for s, n in zip(seqs, lens):
        s.num_computed = n
    return core.runner.build_meta(ScheduledBatch(seqs, [1] * len(lens)))


def _counted(monkeypatch):
    calls = {"decode_stack": 0, "mla_layer": 0, "moe_layer": 0}
    for name in calls:
        fn = getattr(cl, name)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(cl, name, wrapper)
    return calls


def test_stack_equals_the_layer_halves(llm, monkeypatch):
    model, kv = llm.model, llm.engine.core.kv
    ids, meta = _decode_batch(llm, [5, 1, 9])
    calls = _counted(monkeypatch)
    moes = model.moe_layers()
    results = {}
    for stack in (False, True):
        model.fuse_decode_stack = stack
        for m in moes:
            m.load_counts = torch.zeros(m.cfg.n_routed_experts, dtype=torch.int64)
        model.dispatcher.stats.reset()
        model.dispatcher.routing.reset()
        pools = [p.clone() for p in kv.pools]
        hidden = model(ids, meta, pools, StepPlan(3))
        results[stack] = (hidden, pools, [m.load_counts.clone() for m in moes], model.dispatcher.stats.as_dict(),
                          model.dispatcher.routing.tolist())
    model.fuse_decode_stack = True
    for m in moes:
        m.load_counts = None
    assert calls == {"decode_stack": 1, "mla_layer": 3, "moe_layer": 2}
    (h0, p0, c0, s0, r0), (h1, p1, c1, s1, r1) = results[False], results[True]
    assert torch.equal(h0, h1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert all(torch.equal(a, b) for a, b in zip(c0, c1)) and all(int(c.sum()) == 3 * 2 for c in c1)
    assert {k: v for k, v in s0.items() if k != "comm_s"} == {k: v for k, v in s1.items() if k != "comm_s"}
    assert s1["dispatch_calls"] == s1["combine_calls"] == 2 and r0 == r1 == [0, 3 * 2]


def test_steps_the_stack_leaves_to_the_layers(llm, monkeypatch):
    model, kv = llm.model, llm.engine.core.kv
    ids, meta = _decode_batch(llm, [4, 2])
    calls = _counted(monkeypatch)
    seen = []
    model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2), on_layer=seen.append)   # a per-layer hook
    assert seen == [0, 1, 2] and calls["decode_stack"] == 0 and calls["mla_layer"] == 3
    layer = model.model.layers[2].mlp
    layer.expert_map = lambda t: t                                                     # one layer that cannot
    try:
        model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2))
    finally:
        layer.expert_map = None
    assert calls["decode_stack"] == 0 and calls["mla_layer"] == 6 and calls["moe_layer"] == 2 + 1
    model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2))
    assert calls["decode_stack"] == 1


def test_a_bad_slot_is_named_with_its_layer_and_nothing_is_written(llm):
    from attention_mla.meta import AttnMeta
    model, kv = llm.model, llm.engine.core.kv
    ids, meta = _decode_batch(llm, [3, 6])
    S = kv.pools[0].shape[0]
    bad = AttnMeta(meta.positions, torch.tensor([int(meta.slot_mapping[0]), S]), meta.block_table, meta.query_lens,
                   meta.ctx_lens, meta.block_size)
    pools = [p.clone() for p in kv.pools]
    with pytest.raises(ValueError, match=f"decode_stack: layer 0: token 1's slot {S} is outside the pool's {S} rows"):
        model(ids, bad, pools, StepPlan(2))
    assert all(torch.equal(a, b) for a, b in zip(pools, kv.pools))
