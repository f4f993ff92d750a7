"""Sampling: seeds reproduce, degenerate filters equal greedy, logprobs shape; MTP layers skipped."""
from __future__ import annotations

import logging

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

PROMPTS = [[5, 9, 77, 3], [100, 2]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_tiny_checkpoint(str(tmp_path_factory.mktemp("t")), arch="v3", seed=2,
                                    initializer_range=0.2), progress=False)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seed_reproduces_and_differs(llm):
    sp = lambda seed: SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
    a, b, c = (_tokens(llm.generate(PROMPTS, sp(s))) for s in (7, 7, 8))
    assert a == b and a != c


def test_degenerate_filters_equal_greedy(llm):
    greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        sp = SamplingParams(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True, **kw)
        assert _tokens(llm.generate(PROMPTS, sp)) == greedy


def test_logprobs_contain_token_and_top_n(llm):
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=1, max_tokens=6, logprobs=3,
                                                     prompt_logprobs=2, ignore_eos=True))
    c = o.outputs[0]
    assert len(c.logprobs) == 6
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
    assert abs(c.cumulative_logprob - sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs))) < 1e-4
    assert o.prompt_logprobs[0] is None
    assert all(PROMPTS[0][j] in o.prompt_logprobs[j] for j in range(1, 4))


def test_stop_token_finishes_with_stop(llm):
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    first = o.outputs[0].token_ids[0]
    (o,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first]))
    assert o.outputs[0].token_ids == [first] and o.outputs[0].finish_reason == "stop"


def test_mtp_layers_skipped_with_one_log_line(tmp_path, caplog):
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=2, num_nextn_predict_layers=1)
    with caplog.at_level(logging.INFO, logger="wideep.loader"):
        llm = LLM(d, progress=False)
    assert sum("MTP" in r.getMessage() or "multi-token" in r.getMessage() for r in caplog.records) == 1
    assert llm.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids


def test_kept_layout_samples_as_a_fresh_one():
    """The runner keeps a batch's sample_layout over a decode run: drawing with it equals drawing with
    one built from the rows' params that step (greedy, seeded, shared-generator and filtered rows)."""
    import torch

    from wideep.engine.sampling.sampler import sample, sample_layout
    shared, seeded = torch.Generator().manual_seed(5), torch.Generator().manual_seed(9)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=3), SamplingParams(min_p=0.2, top_p=0.9), SamplingParams()]
    gens = [None, seeded, shared, shared, shared, shared]
    kept = sample_layout(params, gens, "cpu")
    assert kept.greedy == 1 and len(kept.groups) == 2
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits = torch.randn(len(params), 40, generator=g) * 2
        states = [shared.get_state(), seeded.get_state()]
        fresh = sample(logits, params, gens)
        shared.set_state(states[0])
        seeded.set_state(states[1])
        again = sample(logits, None, None, layout=kept)
        assert torch.equal(fresh[0], again[0]) and torch.equal(fresh[1], again[1])
        assert int(fresh[0][0]) == int(logits[0].argmax())


def test_logsumexp_equals_torchs_on_peaked_spread_and_masked_rows():
    """The sampler's logsumexp (exponentials clamped 87 below each row's peak, off MKL's slow underflow path) equals
    torch's: rows spread far past e^-87 of their peak, narrow rows, rows with -inf (masks), a row of one finite
    value; and torch's answers for a row all -inf, +inf and nan."""
    import torch

    from wideep.engine.sampling.sampler import logsumexp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=g) * torch.tensor([0.1, 1.0, 30.0, 100.0, 300.0, 30.0])[:, None]
    x[5, ::3] = float("-inf")
    torch.testing.assert_close(logsumexp(x), x.logsumexp(-1), atol=0, rtol=2e-7)
    one = torch.full((1, 7), float("-inf"))
    one[0, 3] = 2.5
    assert logsumexp(one).item() == 2.5
    odd = torch.zeros(3, 5)
    odd[0] = float("-inf")
    odd[1, 2] = float("inf")
    odd[2, 1] = float("nan")
    got, ref = logsumexp(odd), odd.logsumexp(-1)
    assert got[0] == ref[0] == float("-inf") and got[1] == ref[1] == float("inf") and got[2].isnan() and ref[2].isnan()
