"""DeepSeek-V4 with DP attention + EP experts over gloo ranks (2 ranks spawned, 4 under torchrun): every rank's
tokens and prompt logprobs equal the single process's and transformers'; the hash layers route by token id on the
tokens' own rank, before the all-to-all; experts sharded 1/ep; an idle rank still enters every all-to-all; DBO on
gives the same, with EPLB rebalancing too."""
from __future__ import annotations

import pytest
import torch

from tests.oracle import hf_prompt_logprobs
from tests.oracle_v4 import make_v4_model
from tests.parallel.spawn import spawn

pytest.importorskip("transformers")

# 3 prompts on 4 ranks leaves one idle; lengths 2 .. 90 (11 windows)
PROMPTS = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [100 + (i * 7) % 90 for i in range(90)]]
MAX_TOKENS = 8


def _results(outs) -> list[dict]:
    return [{"tokens": o.outputs[0].token_ids,
             "prompt_lp": [o.prompt_logprobs[j][o.prompt_token_ids[j]] for j in range(1, len(o.prompt_token_ids))]}
            for o in outs]


def _rank_main(model_dir: str, ep: int, dbo: bool = False, eplb: bool = False) -> dict:
    from wideep.engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True)
    llm = LLM(model_dir, dp_size=ep, ep_size=ep, progress=False, enable_prefix_caching=False,
              max_num_batched_tokens=24, parallel={"timeout_s": 60.0},
              dbo={"enabled": dbo, "prefill_token_threshold": 2},
              eplb={"enabled": True, "num_redundant_experts": ep, "window_size": 8, "step_interval": 3} if eplb
              else None)
    llm.model.dispatcher.stats.reset()
    out = {"rank": llm.ctx.rank, "param_bytes": llm.model.param_bytes(), "results": _results(llm.generate(PROMPTS, sp)),
           "stats": llm.model.dispatcher.stats.as_dict(), "split_steps": llm.engine.core.split_steps,
           "rebalances": llm.engine.core.eplb.metrics["rebalances"] if eplb else 0}
    llm.shutdown()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from wideep.engine import LLM, SamplingParams
    d = str(tmp_path_factory.mktemp("v4_wide_ep"))
    hf = make_v4_model(d, n_routed_experts=8, num_experts_per_tok=2)
    with torch.no_grad():
        hf_res = [{"tokens": hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                         do_sample=False)[0, len(p):].tolist(),
                   "prompt_lp": hf_prompt_logprobs(hf, p).tolist()} for p in PROMPTS]
    llm = LLM(d, progress=False, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True)
    single = _results(llm.generate(PROMPTS, sp))
    bytes_ = llm.model.param_bytes()
    llm.shutdown()
    return d, hf_res, single, bytes_


def _check(ranks, ep, hf, single, single_bytes, calls: bool = True):
    for r in ranks:
        for g, s, h in zip(r["results"], single, hf, strict=True):
            assert g["tokens"] == s["tokens"] == h["tokens"]
            ours = torch.tensor(g["prompt_lp"])
            assert (ours - torch.tensor(s["prompt_lp"])).abs().max() < 1e-4
            assert (ours - torch.tensor(h["prompt_lp"])).abs().max() < 1e-4
        assert r["param_bytes"]["experts"] * ep == single_bytes["experts"] or not calls   # EPLB: redundant slots
        assert r["stats"]["dispatch_calls"] > 0 or not calls
    assert len({r["stats"]["dispatch_calls"] for r in ranks}) == 1, "every rank entered every all-to-all"


@pytest.mark.multirank
def test_v4_on_2_ep_ranks(reference):
    d, hf, single, single_bytes = reference
    _check(spawn(_rank_main, 2, args=(d, 2), timeout_s=300), 2, hf, single, single_bytes)


@pytest.mark.multirank
def test_v4_on_2_ep_ranks_with_dbo_and_eplb(reference):
    """EPLB rebalances while serving (the hash layers' experts move too: their load is recorded like the others')."""
    d, hf, single, single_bytes = reference
    ranks = spawn(_rank_main, 2, args=(d, 2, True, True), timeout_s=300)
    assert all(r["split_steps"] > 0 and r["rebalances"] > 0 for r in ranks)
    _check(ranks, 2, hf, single, single_bytes, calls=False)   # the microbatches have their own dispatchers


@pytest.mark.multirank
@pytest.mark.slow
def test_v4_on_4_ep_ranks_under_torchrun(reference):
    d, hf, single, single_bytes = reference
    _check(spawn(_rank_main, 4, args=(d, 4), timeout_s=400, launcher="torchrun"), 4, hf, single, single_bytes)


_SHARED = [100 + (i * 11) % 97 for i in range(48)]   # 3 boundaries of 16 tokens (blocks of 8, HCA 16:1)
PREFIXED = [[_SHARED + [7 + i, 9, 11 + j] for i in range(4)] for j in range(2)]   # two rounds: the second hits


_FILL = [[(i * 37 + k * 13) % 190 + 2 for k in range(60)] for i in range(16)]   # pushes a round's prefix out


def _rank_prefix(model_dir: str, ep: int, cache: bool, tiers: bool = False) -> dict:
    """tiers: small pools and a host tier; between the rounds other prompts push the prefix out of the pools."""
    from wideep.engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    kw = dict(kv_cache_blocks=16, kv_cache={"tiers": ["host"], "host_bytes": 1 << 20}) if tiers else {}
    llm = LLM(model_dir, dp_size=ep, ep_size=ep, progress=False, enable_prefix_caching=cache, block_size=8,
              max_num_batched_tokens=24, parallel={"timeout_s": 60.0}, **kw)
    outs = [llm.generate(PREFIXED[0], sp)]
    if tiers:
        llm.generate(_FILL, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outs.append(llm.generate(PREFIXED[1], sp))
    core = llm.engine.core
    res = {"rank": llm.ctx.rank, "tokens": [o.outputs[0].token_ids for r in outs for o in r],
           "lp": [o.outputs[0].cumulative_logprob for r in outs for o in r],
           "cached": [o.metrics["cached_tokens"] for o in outs[1]], "hit_tokens": core.blocks.hit_tokens,
           "host_hits": core.blocks.hit_blocks["host"],
           "whole": all(a.num_free == a.num_blocks for a in core.blocks.allocators.values())}
    llm.shutdown()
    return res


@pytest.mark.multirank
def test_v4_prefix_caching_on_4_ep_ranks(reference):
    """Prefix caching on 4 DP/EP ranks: the second round's requests hit the prefix the first round cached on their
    rank (KV-aware routing sends them there) and give the tokens of one process without prefix caching."""
    d = reference[0]
    from wideep.engine import LLM, SamplingParams
    llm = LLM(d, progress=False, enable_prefix_caching=False, block_size=8)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    single = [o for prompts in PREFIXED for o in llm.generate(prompts, sp)]
    llm.shutdown()
    ranks = spawn(_rank_prefix, 4, args=(d, 4, True), timeout_s=400)
    for r in ranks:
        assert r["tokens"] == [o.outputs[0].token_ids for o in single]
        assert max(abs(a - o.outputs[0].cumulative_logprob) for a, o in zip(r["lp"], single)) < 1e-4
        assert r["whole"]
    assert ranks[0]["cached"] == [48] * 4, ranks[0]["cached"]
    assert sum(r["hit_tokens"] for r in ranks) >= 4 * 48


@pytest.mark.multirank
def test_v4_host_tier_on_4_ep_ranks(reference):
    """The same two rounds with small pools and a host tier per rank: the first round's prefix is pushed out of the
    pools between them, the second round loads it back from the tiers (routed to the ranks whose tiers hold it)
    and gives the tokens of one process without prefix caching."""
    d = reference[0]
    from wideep.engine import LLM, SamplingParams
    llm = LLM(d, progress=False, enable_prefix_caching=False, block_size=8)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    single = [o for prompts in PREFIXED for o in llm.generate(prompts, sp)]
    llm.shutdown()
    ranks = spawn(_rank_prefix, 4, args=(d, 4, True, True), timeout_s=400)
    for r in ranks:
        assert r["tokens"] == [o.outputs[0].token_ids for o in single]
        assert max(abs(a - o.outputs[0].cumulative_logprob) for a, o in zip(r["lp"], single)) < 1e-4
        assert r["whole"]
    assert ranks[0]["cached"] == [48] * 4, ranks[0]["cached"]
    assert sum(r["host_hits"] for r in ranks) > 0
