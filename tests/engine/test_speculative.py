"""Speculative decoding (engine/spec_decode/, engine/spec_decode/verify.py): n-gram drafts verified in one forward.

- The n-gram index proposes what a scan of the history proposes.
- Rejection sampling is exact: the tokens verify() emits are distributed as plain sampling's (many
  seeded trials on a 6-token vocabulary, frequencies within a few standard errors).
- Greedy outputs (tokens and logprobs) equal without speculation: on a random tiny model (drafts
  mostly rejected) and on launch/tiny/cycle.py's model (drafts mostly right), k = 1..3, under KV
  pressure with preemption and prefix caching, with stop tokens and max_tokens inside the accepted
  drafts; the metrics count the drafts; bad configs are errors that name the problem.
"""
from __future__ import annotations

import random

import pytest
import torch

from wideep.engine import LLM, SamplingParams
from wideep.engine.engine_config import EngineConfig
from wideep.engine.sched.scheduler import StepResult
from wideep.engine.spec_decode.config import SpeculativeConfig
from wideep.engine.spec_decode.ngram import NgramIndex, propose_reference
from wideep.engine.sampling.sampler import filter_logits
from wideep.engine.spec_decode.verify import verify
from wideep.launch.tiny import cycle as tiny_cycle
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from wideep.launch.tiny.cycle import make_cycle_checkpoint
from tests.engine.test_engine import drive, workload


def ngram(k=3, lo=2, hi=4, **kw):
    return dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi, **kw)


# -- the turn-down ------------------------------------------------------------------------------------
class _SpecSeq:
    """What the speculator reads of a sequence."""

    def __init__(self):
        self.spec, self.params, self.token_ids = None, SamplingParams(), [1, 2, 3, 1, 2]


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_the_rank_remembers_failing_drafts_and_probes(method):
    """Sequences whose drafts fail raise the rank's pause; while its recent acceptance is low, new sequences
    start backed off (MTP: retired) except one in PROBE_EVERY; a probe that succeeds lowers the pause again
    and new sequences draft at once."""
    from wideep.engine.spec_decode import speculator as sm
    sp = sm.Speculator(SpeculativeConfig(method=method, num_speculative_tokens=2, backoff_steps=4))
    sp.begin(1)
    first = _SpecSeq()
    for _ in range(sm.WINDOW):
        sp.state(first)
        sp.record(first, 2, 0)
    assert first.spec.pause == 4 and first.spec.resume_at == sp.step + 4 and sp.rank_pause == 4
    assert sp.recent == 0.0
    news = [_SpecSeq() for _ in range(sm.PROBE_EVERY)]   # the rank's sequences 2 .. PROBE_EVERY + 1
    for s in news:
        st = sp.state(s)
    paused = [s for s in news if s.spec.resume_at > sp.step]
    probe = [s for s in news if s.spec.resume_at <= sp.step]
    assert len(paused) == sm.PROBE_EVERY - 1 and len(probe) == 1 and news.index(probe[0]) == sm.PROBE_EVERY - 2
    assert all(s.spec.retired == (method == "mtp") and s.spec.pause == 4 for s in paused)
    assert sp.stats()["spec_started_paused"] == sm.PROBE_EVERY - 1
    assert not sp.may_draft_next(paused[0]) and sp.may_draft_next(probe[0])
    # a paused sequence that fails again doubles from the rank's pause (n-gram: it was not retired)
    st = paused[0].spec
    st.retired, st.resume_at = False, 0
    for _ in range(sm.WINDOW):
        sp.record(paused[0], 2, 0)
    assert st.pause == 8 and sp.rank_pause == 8
    # the probe's drafts are right: the rank's average recovers and its pause halves per good judgement
    for _ in range(3 * sm.WINDOW):
        sp.record(probe[0], 2, 2)
    assert sp.recent >= sp.cfg.min_acceptance and sp.rank_pause == 0
    later = _SpecSeq()
    sp.state(later)
    assert later.spec.resume_at == 0 and not later.spec.retired and sp.may_draft_next(later)


# -- the n-gram index ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lo,hi", [(1, 1), (2, 4), (3, 5)])
def test_ngram_index_proposes_what_a_scan_proposes(lo, hi):
    rng = random.Random(lo * 10 + hi)
    for trial in range(30):
        span = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        toks: list[int] = []
        idx = NgramIndex(lo, hi)
        for _ in range(80):   # grows as a sequence does: repeats of a span with noise
            toks.append(span[len(toks) % len(span)] if rng.random() < 0.8 else rng.randrange(6))
            k = rng.randint(1, 4)
            assert idx.propose(toks, k) == propose_reference(toks, k, lo, hi), (trial, toks)


def test_ngram_drafts_continue_a_repeat():
    assert NgramIndex(2, 3).propose([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    assert NgramIndex(2, 3).propose([1, 2, 3], 2) == []          # no earlier occurrence
    assert NgramIndex(2, 3).propose([9, 9, 9, 9], 3) == [9]      # the latest earlier occurrence ends one before the end


# -- config ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,msg", [
    (dict(method="medusa", num_speculative_tokens=2), "method must be one of"),
    (dict(method="ngram"), "num_speculative_tokens must be an integer in \\[1, 16\\]"),
    (dict(method="ngram", num_speculative_tokens=17), "in \\[1, 16\\]"),
    (dict(num_speculative_tokens=2), "needs a method"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "min \\(4\\) > "),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min must be"),
    (dict(method="ngram", num_speculative_tokens=2, min_acceptance=2), "min_acceptance"),
    (dict(method="ngram", num_speculative_tokens=2, disable_by_batch_size=0), "disable_by_batch_size"),
    (dict(method="ngram", num_speculative_tokens=2, lookahead=3), "unknown speculative config keys \\['lookahead'\\]"),
    ("{method: ngram}", "not JSON"),
    (dict(method="ngram", num_speculative_tokens=2, draft_dtype="bfloat16"), "draft_dtype is an option of method"),
    (dict(method="mtp", num_speculative_tokens=2, draft_dtype="fp8"), "draft_dtype must be one of"),
    (dict(method="mtp", num_speculative_tokens=2, draft_dtype=["bf16"]), "draft_dtype must be one of"),
])
def test_bad_speculative_configs_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.coerce(bad)


def test_draft_dtype_names_are_canonical():
    assert SpeculativeConfig(method="mtp", num_speculative_tokens=2, draft_dtype="bf16").draft_dtype == "bfloat16"
    assert SpeculativeConfig(method="mtp", num_speculative_tokens=2).draft_dtype is None


def test_lookup_defaults_are_vllms():
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    cfg = EngineConfig.from_options("m", world_size=1, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert cfg.speculative.num_speculative_tokens == 2


# -- rejection sampling is exact -------------------------------------------------------------------------
class _Seq:
    def __init__(self, drafts, params, gen):
        self.draft_token_ids, self.params, self.generator = drafts, params, gen


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8)])
def test_verified_tokens_are_distributed_as_plain_sampling(kw):
    """Rows with fixed logits (the target's distribution at a position does not depend on the
    tokens before it here): the first output token must be distributed as p_0, and, when draft 0
    was kept, the second as p_1; each is checked to within 5 standard errors over 12,000 draws."""
    V, N = 6, 12000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g) * 1.5
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argsort()[-1])]   # a likely and a likelier draft
    params = SamplingParams(max_tokens=8, **kw)
    f = params.temperature, params.top_k, params.top_p
    p = filter_logits(logits, torch.full((3,), f[0]), torch.full((3,), f[1], dtype=torch.int64),
                      torch.full((3,), f[2])).softmax(-1)
    gen = torch.Generator().manual_seed(11)
    first = torch.zeros(V)
    second, kept0 = torch.zeros(V), 0
    for _ in range(N):
        res = StepResult([None], [None], [None], [None])
        verify(logits, [_Seq(drafts, params, gen)], [2], [0], res)
        out = res.accepted[0].tokens + [res.tokens[0]]
        first[out[0]] += 1
        if out[0] == drafts[0]:
            kept0 += 1
            second[out[1]] += 1
    for emp, n, ref in ((first, N, p[0]), (second, kept0, p[1])):
        se = (ref * (1 - ref) / n).sqrt()
        assert ((emp / n - ref).abs() <= 5 * se + 1e-9).all(), (emp / n, ref)
        assert (emp[ref == 0] == 0).all()   # a filtered-out token is never emitted


def test_greedy_verification_keeps_the_matching_prefix():
    V = 5
    logits = torch.full((4, V), -5.0)
    for r, t in enumerate([2, 3, 1, 4]):
        logits[r, t] = 5.0
    res = StepResult([None], [None], [None], [None])
    verify(logits, [_Seq([2, 3, 0], SamplingParams(temperature=0.0, logprobs=1), None)], [3], [0], res)
    assert res.accepted[0].tokens == [2, 3] and res.tokens[0] == 1
    lse = logits.logsumexp(-1)
    assert res.accepted[0].logprobs == pytest.approx([float(5 - lse[0]), float(5 - lse[1])])
    assert set(res.top[0]) == {1}


# -- through the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("spec")), arch="v3", seed=5, initializer_range=0.3)


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    """A model that mostly continues its cycle, perturbed enough (mix) that some drafts fail."""
    return make_cycle_checkpoint(str(tmp_path_factory.mktemp("cycle")), period=12, mix=6.0, gain=20.0, seed=1)


def cycle_prompts(nxt, n, length=30, seed=0):
    return tiny_cycle.cycle_prompts(nxt, n, length, seed)


def generate(model, prompts, spec=None, max_tokens=40, **kw):
    llm = LLM(model, progress=False, block_size=16, kv_cache_blocks=kw.pop("kv_cache_blocks", 128),
              speculative_config=spec, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    return [o.outputs[0] for o in outs], llm.engine.metrics()


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        assert [list(d.values())[0] for d in x.logprobs] == pytest.approx([list(d.values())[0] for d in y.logprobs],
                                                                          abs=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equal_with_mostly_right_drafts(cycle, k):
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 6)
    ref, _ = generate(d, prompts)
    got, m = generate(d, prompts, ngram(k))
    same(got, ref)
    assert m["spec_decode_num_draft_tokens"] > 0
    rate = m["spec_decode_acceptance_rate"]
    assert 0.3 < rate < 1.0, f"the test model was meant to accept some drafts and reject others: {rate}"
    assert len(m["spec_decode_num_accepted_tokens_per_pos"]) == k
    assert m["spec_decode_mean_acceptance_length"] > 1.2


def test_greedy_equal_with_mostly_wrong_drafts_and_backoff(model_dir):
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 12) for _ in range(rng.randint(5, 40))] for _ in range(5)]   # a small alphabet: many matches
    ref, _ = generate(model_dir, prompts, max_tokens=60)
    got, m = generate(model_dir, prompts, ngram(3, lo=1, hi=2, backoff_steps=4), max_tokens=60)
    same(got, ref)
    assert m["spec_decode_acceptance_rate"] < 0.3
    assert m["spec_decode_backoffs"] > 0


def test_greedy_equal_under_preemption_with_prefix_caching(cycle):
    """Random arrivals, a cache that forces preemption, prefix caching on: every output equals the
    request run alone without speculation, and no block leaks."""
    from wideep.engine.front.engine import Engine
    d, nxt = cycle
    reqs = workload(40, seed=3, max_prompt=60, max_new=40, last_arrival=30)
    ps = cycle_prompts(nxt, 40, seed=9)
    for r, p in zip(reqs, ps):
        r["prompt"] = p[:max(2, len(r["prompt"]) % 30)] + p   # shared starts: prefix-cache hits
    eng = Engine(d, progress=False, block_size=16, kv_cache_blocks=24, max_num_seqs=12, max_num_batched_tokens=96,
                 speculative_config=ngram(3))
    got = drive(eng, reqs)
    m = eng.metrics()
    assert eng.core.scheduler.num_preemptions > 0
    assert m["spec_decode_num_accepted_tokens"] > 0
    assert eng.core.blocks.num_free == eng.core.blocks.allocators["latent"].num_blocks
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, enable_prefix_caching=False)
    for r in reqs:
        want = llm.generate([r["prompt"]], SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
        assert got[r["id"]] == want[0].outputs[0].token_ids, r["id"]


def test_stop_tokens_and_max_tokens_inside_accepted_drafts(cycle):
    """A stop token (and max_tokens) reached among a step's accepted drafts ends the request there."""
    d, nxt = cycle
    prompt = cycle_prompts(nxt, 1, seed=2)[0]
    llm0 = LLM(d, progress=False, block_size=16, kv_cache_blocks=64)
    base = llm0.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, speculative_config=ngram(3))
    for i in (5, 9, 14):
        stop = base.token_ids[i]
        first = base.token_ids.index(stop)
        sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
        for eng in (llm0, llm):
            out = eng.generate([prompt], sp)[0].outputs[0]
            assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    for n in (1, 2, 7, 13):
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == base.token_ids[:n] and out.finish_reason == "length"
    assert llm.engine.core.blocks.num_free == llm.engine.core.blocks.allocators["latent"].num_blocks


def seeded_twice(model, prompts, sp: SamplingParams, spec: dict) -> None:
    """Sampling with drafts: two engines give the same seeded outputs, of full length, with drafts accepted."""
    runs = []
    for _ in range(2):
        llm = LLM(model, progress=False, block_size=16, kv_cache_blocks=64, speculative_config=spec)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        assert llm.engine.metrics()["spec_decode_num_accepted_tokens"] > 0
        assert llm.engine.core.blocks.num_free == llm.engine.core.blocks.allocators["latent"].num_blocks
    assert runs[0] == runs[1] and all(len(t) == sp.max_tokens for t in runs[0])


def test_sampling_with_drafts_is_seeded_and_valid(cycle):
    d, nxt = cycle
    seeded_twice(d, cycle_prompts(nxt, 4, seed=5),
                 SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=7, ignore_eos=True), ngram(2))


def test_requests_with_logits_processing_do_not_draft(cycle):
    d, nxt = cycle
    prompts = cycle_prompts(nxt, 2, seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2)
    llm0 = LLM(d, progress=False, block_size=16, kv_cache_blocks=64)
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64, speculative_config=ngram(3))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == \
        [o.outputs[0].token_ids for o in llm0.generate(prompts, sp)]
    assert llm.engine.metrics()["spec_decode_num_drafts"] == 0


def test_disable_by_batch_size_turns_drafting_off(cycle):
    d, nxt = cycle
    got, m = generate(d, cycle_prompts(nxt, 4), ngram(2, disable_by_batch_size=3), max_tokens=10)
    assert m["spec_decode_num_drafts"] == 0 and m["spec_decode_steps_batch_off"] > 0


def test_prometheus_has_the_spec_decode_families(cycle):
    from wideep.launch.server.prometheus import render
    d, nxt = cycle
    _, m = generate(d, cycle_prompts(nxt, 2), ngram(2), max_tokens=12)
    text = render(m)
    for name in ("wideep_spec_decode_num_drafts_total", "wideep_spec_decode_num_accepted_tokens_total",
                 "wideep_spec_decode_acceptance_rate", "wideep_spec_decode_started_paused_total", 'wideep_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'):
        assert name in text
