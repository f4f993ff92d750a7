"""DeepSeek-V4 through the Engine against transformers 5.24, float32: batched requests with chunked prefill
(chunks that end inside CSA and HCA windows) and decode, prompt logprobs within 1e-4 and greedy tokens equal to
transformers' generate; preemption recomputes the streams; admission counts the streams' real bytes; and what
the engine does not do with V4 yet is refused at construction."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from attention_v4.streams import growing_bytes
from engine import LLM, SamplingParams
from tests.oracle import hf_prompt_logprobs
from tests.oracle_v4 import PRO, YARN, make_v4_model

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(2, 200) for _ in range(n)] for n in (5, 23, 40, 97)]
V4 = dict(dtype="float32", progress=False, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=["flash", "pro_yarn"])
def v4(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    kw = {} if request.param == "flash" else dict(layer_types=PRO, rope_parameters=YARN, seed=1)
    return make_v4_model(d, **kw), d


@torch.no_grad()
def _generate(hf, ids: list[int], n: int) -> list[int]:
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def _check(hf, outs, prompts, n):
    for ids, out in zip(prompts, outs, strict=True):
        ours = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        diff = (ours - hf_prompt_logprobs(hf, ids)).abs().max().item()
        assert diff < 1e-4, f"prompt of {len(ids)} tokens: logprobs differ by {diff}"
        assert out.outputs[0].token_ids == _generate(hf, ids, n), f"prompt of {len(ids)} tokens"


def test_chunked_prefill_and_decode_equal_transformers(v4):
    hf, d = v4
    llm = LLM(d, max_num_batched_tokens=19, **V4)   # 19: chunks end mid-window for every ratio
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)
    _check(hf, llm.generate(PROMPTS, params), PROMPTS, 12)
    core = llm.engine.core
    assert core.kv.streams == {}, "finished sequences' streams are dropped"
    llm.shutdown()


def test_preemption_recomputes_the_streams(v4):
    hf, d = v4
    # 14 blocks of 16 tokens for four sequences of up to 97 + 24 tokens: some are preempted and recompute
    llm = LLM(d, block_size=16, kv_cache_blocks=14, max_num_batched_tokens=64, **V4)
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.core.stats()["preemptions"] > 0
    _check(hf, outs, PROMPTS, 24)
    llm.shutdown()


def test_admission_counts_the_pools_bytes(v4):
    """The engine admits by what its pools allocate: kv_cache_memory pays max_num_seqs slots, then blocks; the
    entries n tokens close always fit the blocks n tokens take (HCA's one per 16 tokens with blocks of 8 too); a
    sequence holds its slot and its blocks."""
    hf, d = v4
    memory = 3 << 20
    llm = LLM(d, block_size=8, max_num_seqs=4, kv_cache_memory=memory, **V4)
    core = llm.engine.core
    kv, att, kinds = core.kv, core.model.cfg.v4.attention, core.model.cfg.v4.layer_kinds
    block = sum(t[0].nbytes for layer in kv.kv.layers for n, t in layer.items() if n in ("compressed", "index_keys"))
    slot = sum(t[0].nbytes for layer in kv.kv.layers for n, t in layer.items() if n not in ("compressed", "index_keys"))
    assert (kv.per_block, kv.per_seq) == (block, slot) and block > 0 and slot > 0
    assert kv.kv.nbytes() == kv.num_blocks * block + 4 * slot <= memory
    assert kv.num_blocks == min(4 * -(-core.max_model_len // 8), (memory - 4 * slot) // block)
    for n in range(1, 300):
        assert sum(growing_bytes(att, k, n, 4) for k in kinds) <= block * -(-n // 8), n
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and kv.streams == {} and len(kv._free_slots) == 4
    llm.shutdown()


def test_too_little_memory_for_the_fixed_streams_is_named(v4):
    hf, d = v4
    with pytest.raises(ValueError, match=r"kv_cache_memory \(1000 bytes\) is less than the DeepSeek-V4 streams every "
                                         r"sequence holds"):
        LLM(d, kv_cache_memory=1000, **V4)


@pytest.mark.parametrize("options,match", [
    (dict(enable_prefix_caching=True), r"prefix caching \(pass enable_prefix_caching=False"),
    (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype 'fp8'"),
    (dict(enable_prefix_caching=True, kv_cache={"tiers": ["host"]}), r"the host/disk KV tiers"),
    (dict(speculative_config=dict(method="ngram", num_speculative_tokens=2)), r"speculative decoding"),
])
def test_what_v4_does_not_do_yet_is_refused(v4, options, match):
    hf, d = v4
    kw = dict(V4, **options)
    with pytest.raises(ValueError, match=r"DeepSeek-V4 does not support .*" + match):
        LLM(d, **kw)


def test_disaggregation_is_refused(v4):
    from disagg.decode import DecodeHooks
    from disagg.prefill import PrefillHooks
    hf, d = v4
    llm = LLM(d, **V4)
    for hooks in (PrefillHooks(None, 0), DecodeHooks(None, 0)):
        with pytest.raises(ValueError, match="does not transfer DeepSeek-V4's KV streams"):
            hooks.attach(llm.engine.core)
    llm.shutdown()


def test_dbo_equals_plain_steps(v4):
    """DBO on: steps split in two microbatches (a prefill chunk cut mid-sequence, decodes split by request) give
    transformers' tokens and logprobs too."""
    hf, d = v4
    llm = LLM(d, max_num_batched_tokens=19, dbo={"enabled": True, "prefill_token_threshold": 2}, **V4)
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.core.stats()["dbo_split_steps"] > 0
    _check(hf, outs, PROMPTS, 12)
    llm.shutdown()


@pytest.mark.parametrize("options,match", [
    (dict(attention_backend="cpu"), r"DeepSeek-V4 attention runs on the torch backend only, not attention_backend"),
    (dict(experts_backend="triton"), r"DeepSeek-V4 experts \(clamped SwiGLU\) run on the torch or cpu backend, not "
                                     r"experts_backend 'triton'"),
    (dict(quantization="fp4"), r"quantization 'fp4' keeps DeepSeek-V4's FP4 experts as stored, but the checkpoint's "
                               r"routed experts are not FP4"),
])
def test_backends_without_v4_kernels_are_refused(v4, options, match):
    hf, d = v4
    with pytest.raises(ValueError, match=match):
        LLM(d, **dict(V4, **options))


def test_the_cpu_decode_plan_never_sees_v4_layers(v4):
    """The CPU backend's fused decode (cpu/decode_plan.py) is not built for V4: every step runs the torch ops."""
    hf, d = v4
    llm = LLM(d, **V4)
    assert llm.model.decode_plan is None and llm.model.backends["decode"] == "ops"
    assert llm.model.backends["attention"] == llm.model.backends["experts"] == "torch"
    llm.shutdown()
