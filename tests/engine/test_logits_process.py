"""Logits processing (min_tokens, logit_bias, penalties, min_p) against torch references on crafted
logits, and its effect end to end through LLM.generate on a tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from wideep.engine import LLM, SamplingParams
from wideep.engine.sched.sequence import Sequence
from wideep.engine.sampling.logits_process import LogitsProcessor
from wideep.engine.sampling.sampler import filter_logits
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

V = 32


def _seq(prompt, output, **kw):
    p = SamplingParams(max_tokens=64, **kw)
    return Sequence(request_id="r", prompt=None, prompt_token_ids=list(prompt), params=p, max_tokens=64,
                    eos_token_ids=(1,), output_token_ids=list(output))


def _reference(logits: torch.Tensor, s: Sequence) -> torch.Tensor:
    """One row, loops over tokens: vLLM's formulas spelled out."""
    p, x = s.params, logits.clone()
    if len(s.output_token_ids) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(s.eos_token_ids)):
            x[t] = -math.inf
    for t, v in (p.logit_bias or {}).items():
        x[t] += v
    for t in range(V):
        c = s.output_token_ids.count(t)
        if c or t in s.prompt_token_ids:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


CASES = [dict(),
         dict(repetition_penalty=1.7), dict(repetition_penalty=0.6),
         dict(frequency_penalty=0.9), dict(presence_penalty=-1.3),
         dict(logit_bias={4: 5.0, 9: -100.0}), dict(min_tokens=5, stop_token_ids=[7]),
         dict(min_tokens=5, ignore_eos=True, stop_token_ids=[8]), dict(min_tokens=2),
         dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, logit_bias={3: 2.0})]


def _sample_step(proc, plan, seqs, g) -> None:
    """A step's random samples recorded by the processor and appended to the sequences' outputs."""
    tokens = torch.randint(0, V, (len(seqs),), generator=g)
    proc.record(plan, tokens)
    for b, s in enumerate(seqs):
        s.output_token_ids.append(int(tokens[b]))


@pytest.mark.parametrize("subset", [False, True])
def test_processing_matches_reference(subset):
    g = torch.Generator().manual_seed(0)
    seqs = [_seq(torch.randint(0, V, (6,), generator=g).tolist(), torch.randint(0, V, (3,), generator=g).tolist(),
                 **kw) for kw in CASES]
    if subset:   # every row penalised: the no-gather path
        seqs = [s for s in seqs if s.params.penalised]
    logits = torch.randn(len(seqs), V, generator=g) * 3
    proc = LogitsProcessor(V, "cpu")
    plan = proc.plan(seqs)
    out = proc.apply(logits, plan)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(out[b], _reference(logits[b], s))
    # counts grow incrementally with this step's samples, and match a rebuild from the tokens
    _sample_step(proc, plan, seqs, g)
    logits = torch.randn(len(seqs), V, generator=g)
    out = proc.apply(logits, proc.plan(seqs))
    fresh = LogitsProcessor(V, "cpu")
    torch.testing.assert_close(out, fresh.apply(logits, fresh.plan(seqs)))
    for b, s in enumerate(seqs):
        torch.testing.assert_close(out[b], _reference(logits[b], s))


def test_slots_out_of_batch_order_and_masked_tokens():
    """Pool rows taken out of batch order (gathered, not a view of consecutive slots), and a -inf
    (min_tokens) logit of a token in the prompt through the repetition penalty: it stays -inf."""
    g = torch.Generator().manual_seed(2)
    kw = dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.2, min_tokens=9, stop_token_ids=[5])
    seqs = [_seq([5] + torch.randint(0, V, (5,), generator=g).tolist(), torch.randint(0, V, (4,), generator=g).tolist(),
                 **kw) for _ in range(4)]
    proc = LogitsProcessor(V, "cpu")
    proc.plan(seqs)                       # slots 0..3 in this order
    seqs = seqs[::-1]                     # the next batch holds them the other way round
    for step in range(2):
        plan = proc.plan(seqs)
        assert not isinstance(plan.pen_slot_rows, slice)
        logits = torch.randn(len(seqs), V, generator=g) * 3
        out = proc.apply(logits, plan)
        assert torch.isneginf(out[:, 5]).all()
        for b, s in enumerate(seqs):
            torch.testing.assert_close(out[b], _reference(logits[b], s))
        _sample_step(proc, plan, seqs, g)


def test_no_processing_no_plan():
    assert LogitsProcessor(V, "cpu").plan([_seq([2, 3], [4]), _seq([5], [], temperature=0.5)]) is None


def test_pool_reuses_finished_slots():
    proc = LogitsProcessor(V, "cpu")
    seqs = [_seq([2], [], presence_penalty=1.0) for _ in range(8)]
    proc.plan(seqs)
    assert proc.counts.out_counts.shape[0] == 8
    for s in seqs[:3]:
        s.finish_reason = "stop"
    proc.plan([_seq([3], [], presence_penalty=1.0) for _ in range(3)])
    assert proc.counts.out_counts.shape[0] == 8


def test_min_p_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g) * 2
    temp, min_p = torch.tensor([1.0, 0.7, 1.3, 1.0]), torch.tensor([0.0, 0.1, 0.3, 1.0])
    out = filter_logits(logits, temp, torch.full((4,), -1), torch.ones(4), min_p)
    probs = (logits / temp[:, None]).softmax(-1)
    keep = probs >= min_p[:, None] * probs.amax(-1, keepdim=True)
    assert torch.equal(torch.isfinite(out), keep)
    torch.testing.assert_close(out[keep], (logits / temp[:, None])[keep])


@pytest.mark.parametrize("kw", [dict(min_p=1.5), dict(min_p=-0.1), dict(presence_penalty=2.5),
                                dict(frequency_penalty=-3), dict(repetition_penalty=0.0),
                                dict(repetition_penalty=float("nan")), dict(min_tokens=-1),
                                dict(min_tokens=20, max_tokens=10), dict(logit_bias={"5": 1.0}),
                                dict(logit_bias={5: float("inf")}), dict(logit_bias=[1, 2])])
def test_bad_values_name_the_field(kw):
    field = next(iter(kw))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logit_bias_clamped():
    assert SamplingParams(logit_bias={3: 250, 4: -1e9}).logit_bias == {3: 100.0, 4: -100.0}


# ---- end to end --------------------------------------------------------------------------------

from tests.engine.test_sampling import PROMPTS, _tokens, llm  # noqa: E402,F401  (the same tiny model and prompts)


def test_logit_bias_forces_a_token(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                logit_bias={42: 100.0}))
    assert _tokens(outs) == [[42] * 6] * 2


def test_huge_repetition_penalty_prevents_repeats(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert any(len(set(t)) < len(t) for t in _tokens(llm.generate(PROMPTS, plain)))   # it does repeat
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1e6,
                        logit_bias={7: 0.0})   # bias 0: exercise the bias path too, no effect
    for prompt, toks in zip(PROMPTS, _tokens(llm.generate(PROMPTS, sp))):
        assert len(set(toks)) == len(toks) and not set(toks) & set(prompt)


def test_min_tokens_prevents_early_stop(llm):
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    first = o.outputs[0].token_ids[0]
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first],
                                                     min_tokens=4, ignore_eos=True))
    toks = o.outputs[0].token_ids
    assert len(toks) >= 4 and first not in toks[:4]


def test_logprobs_stay_raw_with_processing(llm):
    kw = dict(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    (plain,) = llm.generate([PROMPTS[0]], SamplingParams(**kw))
    (biased,) = llm.generate([PROMPTS[0]], SamplingParams(**kw, logit_bias={plain.outputs[0].token_ids[0]: 0.0}))
    assert plain.outputs[0].logprobs == biased.outputs[0].logprobs


def test_seed_same_samples_whatever_the_batch(llm):
    """A seeded request's samples depend on its seed only, not on the rows it shares a step with."""
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True, presence_penalty=0.5)
    alone = _tokens(llm.generate([PROMPTS[0]], sp))[0]
    others = [SamplingParams(temperature=0.9, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True, frequency_penalty=1.0)]
    batch = llm.generate([PROMPTS[1], PROMPTS[0], [8, 8, 8]], [others[0], sp, others[1]])
    assert batch[1].outputs[0].token_ids == alone


def test_out_of_vocab_logit_bias_rejected_at_admission(llm):
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={10 ** 6: 1.0}))


def test_penalised_under_preemption_equal_alone(tmp_path):
    """Preempted sequences recompute their KV; their token counts stay right (kept, or rebuilt)."""
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=2, initializer_range=0.2)
    sp = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3 + 0.1 * i,
                         frequency_penalty=0.4, logit_bias={9 + i: 1.5}) for i in range(6)]
    prompts = [[3 + i, 11, 60, 2 * i + 5] for i in range(6)]
    alone = LLM(d, progress=False, block_size=16, kv_cache_blocks=64)
    want = [alone.generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts, sp)]
    tight = LLM(d, progress=False, block_size=16, kv_cache_blocks=9)
    assert _tokens(tight.generate(prompts, sp)) == want
    assert tight.engine.core.scheduler.num_preemptions > 0
