"""The CPU decode plan (engine/model/fused_decode.py): a decode step's decoder layers as one C call
(decode_stack) against the same step a layer half at a time, and both against the operations: bit-equal outputs
and caches (the same C calls), EPLB's load counts, the dispatcher's counters and routing histogram; the path each
kind of step takes and the reason counted when it is not the whole stack (a per-layer hook, an EPLB map, a
prefill, too many rows); a bad slot named with its layer."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla import mla as mla_module
from wideep.cpu import fused as cl
from wideep.cpu.build import unusable
from wideep.parallel.step_plan import StepPlan

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from wideep.engine import LLM
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("stack")), "v3", num_hidden_layers=3, first_k_dense_replace=1,
                             n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, vocab_size=200,
                             seed=3, initializer_range=0.2)
    return LLM(d, dtype="float32", device="cpu", progress=False, block_size=4, kv_cache_blocks=32, max_num_seqs=4)


def _decode_batch(llm, lens):
    """A decode step of len(lens) sequences whose contexts hold lens[b] tokens (cache rows written by a
    prefill through the model) -> (input_ids, meta)."""
    from wideep.engine.worker.messages import NewRequest
    from wideep.engine.sched.scheduler import ScheduledBatch
    from wideep.engine import SamplingParams
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
        model.decode_plan.fuse_stack = stack
        for m in moes:
            m.routing.load_counts = torch.zeros(m.cfg.n_routed_experts, dtype=torch.int64)
        model.dispatcher.stats.reset()
        model.dispatcher.routing.reset()
        pools = [p.clone() for p in kv.pools]
        hidden = model(ids, meta, pools, StepPlan(3))
        results[stack] = (hidden, pools, [m.load_counts.clone() for m in moes], model.dispatcher.stats.as_dict(),
                          model.dispatcher.routing.tolist())
    model.decode_plan.fuse_stack = True
    for m in moes:
        m.routing.load_counts = None
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
    layer.routing.expert_map = lambda t: t                                                     # one layer that cannot
    try:
        model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2))
    finally:
        layer.routing.expert_map = None
    assert calls["decode_stack"] == 0 and calls["mla_layer"] == 6 and calls["moe_layer"] == 2 + 1
    model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2))
    assert calls["decode_stack"] == 1


def test_a_bad_slot_is_named_with_its_layer_and_nothing_is_written(llm):
    from wideep.attention_mla.meta import AttnMeta
    model, kv = llm.model, llm.engine.core.kv
    ids, meta = _decode_batch(llm, [3, 6])
    S = kv.pools[0].shape[0]
    bad = AttnMeta(meta.positions, torch.tensor([int(meta.slot_mapping[0]), S]), meta.block_table, meta.query_lens,
                   meta.ctx_lens, meta.block_size)
    pools = [p.clone() for p in kv.pools]
    with pytest.raises(ValueError, match=f"decode_stack: layer 0: token 1's slot {S} is outside the pool's {S} rows"):
        model(ids, bad, pools, StepPlan(2))
    assert all(torch.equal(a, b) for a, b in zip(pools, kv.pools))


def _ops_run(model, ids, meta, pools):
    """The same step through the model's operations (no plan)."""
    plan, model.decode_plan = model.decode_plan, None
    try:
        return model(ids, meta, pools, StepPlan(ids.shape[0]))
    finally:
        model.decode_plan = plan


def test_every_path_equals_the_operations(llm):
    """stack, layers (a hook forces it) and the operations give the same hidden states and caches; the
    fused halves are the same kernels, so the hidden states are bit-equal."""
    model, kv = llm.model, llm.engine.core.kv
    ids, meta = _decode_batch(llm, [5, 1, 9])
    ref_pools = [p.clone() for p in kv.pools]
    ref = _ops_run(model, ids, meta, ref_pools)
    for hook in (None, lambda i: None):
        pools = [p.clone() for p in kv.pools]
        out = model(ids, meta, pools, StepPlan(3), on_layer=hook)
        assert model.backends["decode"] == ("stack" if hook is None else "layers")
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(pools, ref_pools):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _sequence(core, name: str, prompt_len: int, computed: int, first_block: int):
    """A sequence with a prompt of prompt_len tokens, the first `computed` of them in the cache (written by
    _prefill), blocks first_block .. first_block + 7."""
    from wideep.engine import SamplingParams
    from wideep.engine.worker.messages import NewRequest
    b = first_block // 8
    s = core.make_sequence(NewRequest(name, [3 + (7 * b + j) % 150 for j in range(prompt_len)],
                                      SamplingParams(max_tokens=1), b, 0.0))
    s.block_ids = list(range(first_block, first_block + 8))
    return s


def test_a_mixed_step_runs_the_stack_and_equals_the_operations(llm, monkeypatch):
    """Decodes, a whole prompt and a prompt's second chunk (after its cached first one) in one step of at most
    PAGED_STEP_TOKENS tokens: every query attends on the paged kernel, one kernel row a token, so the step runs
    the whole stack, equal to the operations' (the same C calls), its caches too; and each chunk's rows equal
    those of the same tokens prefilled alone (causal: a token sees its own position and the ones before)."""
    from wideep.engine.sched.scheduler import ScheduledBatch
    core, model = llm.engine.core, llm.model
    old = [_sequence(core, "m0", 6, 0, 0), _sequence(core, "m1", 9, 0, 8)]
    ids, meta = core.runner.build_meta(ScheduledBatch(old, [5, 4]))     # m0 5 of 6 tokens, m1 its first chunk
    model(ids, meta, core.kv.pools, StepPlan(9))
    old[0].num_computed, old[1].num_computed = 5, 4
    new = _sequence(core, "m2", 7, 0, 16)
    ids, meta = core.runner.build_meta(ScheduledBatch(old + [new], [1, 5, 7]))
    assert meta.query_lens == [1, 5, 7] and meta.paged_decode_tables("auto", 13) is not None
    ref_pools = [p.clone() for p in core.kv.pools]
    ref = _ops_run(model, ids, meta, ref_pools)
    pools = [p.clone() for p in core.kv.pools]
    out = model(ids, meta, pools, StepPlan(13))
    assert model.backends["decode"] == "stack"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(pools, ref_pools):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    alone_ids, alone_meta = core.runner.build_meta(ScheduledBatch([new], [7]))
    alone = model(alone_ids, alone_meta, [p.clone() for p in core.kv.pools], StepPlan(7))
    torch.testing.assert_close(out[6:], alone, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(mla_module, "PAGED_STEP_TOKENS", 0)     # the chunks' attention in the naive form
    naive = _ops_run(model, ids, meta, [p.clone() for p in core.kv.pools])
    torch.testing.assert_close(out, naive, rtol=1e-4, atol=1e-4)


def test_the_reason_is_counted_for_every_step_it_does_not_fuse(llm, monkeypatch):
    plan = llm.model.decode_plan
    model, kv = llm.model, llm.engine.core.kv
    before = dict(plan.declined), dict(plan.stack_declined), dict(plan.steps)
    ids, meta = _decode_batch(llm, [4, 2])           # (its prefill: a small prefill step -> the stack)
    with monkeypatch.context() as m:                 # a prefill past the paged kernel's step size -> mlp_halves
        m.setattr(mla_module, "PAGED_STEP_TOKENS", 4)
        _decode_batch(llm, [5, 3])
    model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2), on_layer=lambda i: None)
    layer = model.model.layers[2].mlp
    layer.routing.expert_map = lambda t: t
    try:
        model(ids, meta, [p.clone() for p in kv.pools], StepPlan(2))
    finally:
        layer.routing.expert_map = None
    empty = ids[:0]
    from wideep.attention_mla.meta import AttnMeta
    none = AttnMeta(meta.positions[:0], meta.slot_mapping[:0], meta.block_table[:0], [], [], meta.block_size)
    model(empty, none, kv.pools, StepPlan(0))
    d = {k: plan.declined[k] - before[0][k] for k in plan.declined}
    sd = {k: plan.stack_declined[k] - before[1][k] for k in plan.stack_declined}
    st = {k: plan.steps[k] - before[2][k] for k in plan.steps}
    assert st == {"stack": 1, "layers": 2, "mlp_halves": 1, "ops": 1}
    assert d["not_all_decode"] == 1 and d["no_tokens"] == 1 and sum(d.values()) == 2
    assert sd["layer_hook"] == 1 and sd["expert_map"] == 1 and sum(sd.values()) == 2
    assert model.backends["decode"] == "ops"
    stats = llm.engine.core.stats()
    assert stats["decode_steps_layers"] == plan.steps["layers"] and "decode_declined_too_many_rows" in stats


def test_prometheus_shows_the_paths_and_reasons():
    from wideep.launch.server.prometheus import parse, render
    text = render({"per_rank": [{"decode_steps_stack": 7, "decode_steps_ops": 2, "decode_declined_too_many_rows": 2,
                                 "decode_stack_declined_ep_group": 0}]})
    got = parse(text)
    assert got['wideep_rank_decode_steps_total{dp_rank="0",path="stack"}'] == 7
    assert got['wideep_rank_decode_declined_total{dp_rank="0",reason="too_many_rows"}'] == 2
    assert got['wideep_rank_decode_stack_declined_total{dp_rank="0",reason="ep_group"}'] == 0
