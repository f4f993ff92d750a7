"""DeepSeek-V3.2 (DSA) in the engine: chunked prefill, prefix caching and preemption give each request's
outputs run alone; the indexer-key cache is sized and reported beside the latent's; at ep 2 and 4
(DBO on, EPLB rebalancing while it serves) the results equal one process; every decode step equals a
fresh prefill of its prefix (contexts many times index_topk, across small blocks, exact index-score ties,
both attention backends), and greedy tokens equal transformers' generate."""
from __future__ import annotations

import random

import pytest
import torch

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.engine.test_engine import drive, greedy
from tests.parallel.spawn import spawn

TOPK = 8
_rng = random.Random(4)
SYSTEM = [_rng.randrange(2, 250) for _ in range(40)]   # shared by some prompts: prefix-cache hits
PROMPTS = [SYSTEM + [_rng.randrange(2, 250) for _ in range(n)] for n in (3, 30, 90)] + \
          [[_rng.randrange(2, 250) for _ in range(n)] for n in (1, 7, 150, 61)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # sharp random weights: greedy choices far from ties, so batch shapes cannot flip them
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("dsa")), arch="v32", seed=2, initializer_range=0.25,
                                index_topk=TOPK)


def _results(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
            for o in outs]


def _sp() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def single(model_dir):
    llm = LLM(model_dir, progress=False, enable_prefix_caching=False)
    out = _results(llm.generate(PROMPTS, _sp()))
    llm.shutdown()
    return out


def _close(got, want, tol: float = 1e-4) -> None:
    for (tok, lp), (tok_ref, lp_ref) in zip(got, want, strict=True):
        assert tok == tok_ref
        if lp_ref:
            assert (torch.tensor(lp) - torch.tensor(lp_ref)).abs().max() <= tol


def test_index_key_cache_is_sized_and_reported_beside_the_latent(model_dir):
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_memory=4 * 2 ** 20)
    kv, L = llm.engine.core.kv, 4
    assert kv.index_dim == 32 and len(kv.index_pools) == L and kv.index_pools[0].shape == kv.pools[0].shape[:1] + (32,)
    per_token = llm.engine.core.stats()["kv_bytes_per_token"]
    assert per_token == {"latent": L * (32 + 8) * 4, "index_keys": L * 32 * 4}
    # the memory budget pays for both: 4 MiB / (16 tokens x (160 + 128) bytes x 4 layers)
    assert kv.num_blocks == 4 * 2 ** 20 // (16 * 4 * (40 + 32) * 4)
    llm.shutdown()


def test_chunked_prefill_prefix_cache_and_preemption_equal_alone(model_dir, single):
    """Prompts cut into 32-token chunks, the 40-token system prompt served from the prefix cache, a cache
    small enough that sequences are preempted and recomputed: every request's tokens as run alone."""
    eng = Engine(model_dir, progress=False, block_size=8, kv_cache_blocks=24, max_num_seqs=4,
                 max_num_batched_tokens=32)
    reqs = [dict(id=f"r{i}", prompt=p, max_tokens=MAX_TOKENS, arrival=i // 3) for i, p in enumerate(PROMPTS)]
    got = drive(eng, reqs)
    core = eng.core
    assert core.scheduler.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    assert core.blocks.hit_tokens > 0, "the shared system prompt was meant to hit the prefix cache"
    assert core.blocks.num_free == core.blocks.allocators["latent"].num_blocks
    eng.shutdown()
    assert [got[r["id"]] for r in reqs] == [tok for tok, _ in single]


def _rank(model_dir: str, ep: int) -> list:
    from wideep.eplb import EplbConfig
    eplb = EplbConfig(enabled=True, num_redundant_experts=ep, window_size=16, step_interval=3)
    llm = LLM(model_dir, dp_size=ep, ep_size=ep, dispatch_backend="torch", progress=False, dbo={"enabled": True},
              eplb=eplb, parallel={"timeout_s": 60.0}, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    out = _results(llm.generate(PROMPTS, _sp()))
    core = llm.engine.core
    stats = {"split_steps": core.split_steps, "rebalances": core.eplb.metrics["rebalances"]}
    llm.shutdown()
    return [out, stats]


@pytest.mark.multirank
@pytest.mark.parametrize("ep", [2, 4])
def test_wide_ep_with_dbo_and_eplb_equals_one_process(model_dir, single, ep):
    for out, stats in spawn(_rank, ep, args=(model_dir, ep), timeout_s=400):
        _close(out, single)
        assert stats["split_steps"] > 0 and stats["rebalances"] > 0, stats


# two indexer heads: a token neither head scores above 0 scores exactly 0, the best score where both head
# weights are negative, so many queries choose among exact ties at the k-th place
TIES_TOPK, VOCAB = 4, 256
_tie_rng = random.Random(23)
TIES_PROMPTS = [[_tie_rng.randrange(2, 250) for _ in range(n)] for n in (13, 30, 47)]   # 3-12 x index_topk
HF_PROMPTS = [[_tie_rng.randrange(2, 200) for _ in range(n)] for n in (21, 58)]


@pytest.fixture(scope="module")
def ties_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("dsa_ties")), arch="v32", seed=5, initializer_range=0.25,
                                index_topk=TIES_TOPK, index_n_heads=2)


def _decode_equals_fresh_prefill(llm, prompts: list[list[int]], n: int) -> None:
    """Greedy decode of `prompts` in one batch, then every prefix prompt + generated[:i] prefilled afresh:
    decode step i's token is the prefill's argmax, and their logprobs of every token agree."""
    every = dict(temperature=0.0, logprobs=VOCAB, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=n, **every))]
    prefixes = [(p + out.token_ids[:i], out, i) for p, out in zip(prompts, outs) for i in range(n)]
    fresh = llm.generate([ids for ids, _, _ in prefixes], SamplingParams(max_tokens=1, **every))
    for (ids, out, i), f in zip(prefixes, fresh, strict=True):
        want, got = f.outputs[0].logprobs[0], out.logprobs[i]
        assert out.token_ids[i] == max(want, key=want.get), f"context {len(ids)}: decode step {i} != prefill"
        diff = max(abs(got[t] - want[t]) for t in want)
        assert diff <= 1e-4, f"context {len(ids)}, decode step {i}: logprobs differ by {diff}"


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_decode_equals_a_fresh_prefill_of_its_prefix(ties_dir, attention):
    """3-token blocks: every decode step's context crosses block boundaries; prefix caching off, so each
    prefix is really prefilled again."""
    llm = LLM(ties_dir, progress=False, block_size=3, enable_prefix_caching=False, max_logprobs=VOCAB,
              attention_backend=attention)
    _decode_equals_fresh_prefill(llm, TIES_PROMPTS, 10)
    llm.shutdown()


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    """A transformers-built model with index_topk 4 under prompts of 21 and 58 tokens, and 16 indexer heads:
    no exact ties, whose pick in transformers is torch.topk's own (it depends on the row's length, so its
    cached generate and its full forward may differ there). transformers' generate agrees with its full
    forward of every prefix, and our greedy tokens equal both."""
    pytest.importorskip("transformers")
    from tests.oracle import hf_greedy, make_hf_model
    hf = make_hf_model("v32", str(tmp_path), seed=3, bias_std=0.2, index_topk=4)
    prompts, n = HF_PROMPTS, 10
    llm = LLM(str(tmp_path), dtype="float32", progress=False, block_size=4, enable_prefix_caching=False)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n))]
    llm.shutdown()
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        assert gen == hf_greedy(hf, ids, n), "transformers' cached generate is not its own full forward"
        assert got == gen, f"prompt of {len(ids)} tokens"
