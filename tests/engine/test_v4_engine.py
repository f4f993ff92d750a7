"""DeepSeek-V4 through the Engine against transformers 5.24, float32: batched requests with chunked prefill
(chunks that end inside CSA and HCA windows) and decode, prompt logprobs within 1e-4 and greedy tokens equal to
transformers' generate; preemption recomputes the streams; admission counts the streams' real bytes; and what
the engine does not do with V4 yet is refused at construction."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.attention_v4.streams import growing_bytes
from wideep.engine import LLM, SamplingParams
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
    assert _empty(core), "finished sequences' streams are dropped, their blocks back in every pool"
    llm.shutdown()


def _empty(core) -> bool:
    """Every pool's blocks and every slot free, no streams left."""
    b = core.blocks
    return (all(a.num_free == a.num_blocks for a in b.allocators.values()) and b.free_slots == b.num_slots
            and core.kv.streams == {})


def test_preemption_recomputes_the_streams(v4):
    hf, d = v4
    # 14 blocks of 16 tokens for four sequences of up to 97 + 24 tokens: some are preempted and recompute
    llm = LLM(d, block_size=16, kv_cache_blocks=14, max_num_batched_tokens=64, **V4)
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    core = llm.engine.core
    assert core.stats()["preemptions"] > 0
    _check(hf, outs, PROMPTS, 24)
    assert _empty(core), f"blocks left held: {core.blocks.usage()}"
    llm.shutdown()


def test_kv_pressure_equals_solo_runs_and_leaks_nothing(v4):
    """Eight requests through pools too small for them at once (blocks of 8 tokens: windows span two, CSA keeps
    2 entries a block, HCA one per 16 tokens; chunks of 24 end mid-window): preempted sequences recompute every
    stream and give what each request gives alone; afterwards every pool is whole."""
    hf, d = v4
    rng = random.Random(5)
    prompts = PROMPTS + [[rng.randrange(2, 200) for _ in range(n)] for n in (61, 9, 33, 75)]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
    llm = LLM(d, block_size=8, kv_cache_blocks=28, max_num_batched_tokens=24, **V4)
    outs = llm.generate(prompts, params)
    core = llm.engine.core
    stats = core.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert _empty(core), f"blocks left held: {core.blocks.usage()}"
    llm.shutdown()
    solo = LLM(d, block_size=8, max_num_seqs=1, **V4)
    for ids, out in zip(prompts, outs, strict=True):
        alone = solo.generate([ids], params)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids, f"prompt of {len(ids)} tokens"
        assert abs(out.outputs[0].cumulative_logprob - alone.cumulative_logprob) < 1e-4
    assert _empty(solo.engine.core)
    solo.shutdown()


def test_admission_counts_the_pools_bytes(v4):
    """The engine admits by what its pools allocate: kv_cache_memory pays max_num_seqs slots and the window pool
    (every slot's decode window and one step's tokens) first, then the compressed pools by their bytes per token;
    each stream's blocks hold exactly the entries their tokens close, up to one part-filled block (HCA: one entry
    per 16 tokens, blocks of one entry); a finished request leaves every pool whole."""
    hf, d = v4
    memory = 3 << 20
    llm = LLM(d, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=memory, **V4)
    core = llm.engine.core
    kv, att, kinds, g = core.kv, core.model.cfg.v4.attention, core.model.cfg.v4.layer_kinds, core.kv.spec
    per_block = dict.fromkeys(g.streams, 0)
    for layer, stream_of in zip(kv.kv.layers, kv.kv.stream_of):
        for n, st in stream_of.items():
            per_block[st] += layer[n][0].nbytes
    slot = sum(t[0].nbytes for layer, so in zip(kv.kv.layers, kv.kv.stream_of) for n, t in layer.items()
               if n not in so)
    assert kv.per_block == per_block and kv.per_slot == slot > 0 and set(g.streams) == {"window", "csa", "hca"}
    assert kv.kv.nbytes() == sum(kv.num_blocks[s] * per_block[s] for s in g.streams) + 4 * slot <= memory
    assert kv.num_blocks["window"] == 4 * g.decode_window() + 32 // 8 + 1
    assert (g.rows("window"), g.rows("csa"), g.rows("hca")) == (8, 2, 1)
    for n in range(1, 300):
        for k in ("csa", "hca"):
            data = sum(growing_bytes(att, x, n, 4) for x in kinds if x == k)
            held = g.entry_blocks(k, n) * per_block[k]
            assert data <= held < data + per_block[k], (k, n)
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and _empty(core)
    llm.shutdown()


def test_too_little_memory_for_the_fixed_streams_is_named(v4):
    hf, d = v4
    with pytest.raises(ValueError, match=r"kv_cache_memory \(1000 bytes\) is less than the DeepSeek-V4 streams every "
                                         r"sequence holds"):
        LLM(d, kv_cache_memory=1000, **V4)


@pytest.mark.parametrize("options,match", [
    (dict(kv_cache_dtype="fp4"), r"kv_cache_dtype 'fp4' \(V4 streams are kept in the model dtype or fp8"),
    (dict(kv_cache_dtype="fp4_e2m1"), r"kv_cache_dtype 'fp4_e2m1'"),
])
def test_what_v4_does_not_do_yet_is_refused(v4, options, match):
    hf, d = v4
    kw = dict(V4, **options)
    with pytest.raises(ValueError, match=r"DeepSeek-V4 does not support .*" + match):
        LLM(d, **kw)


def test_dbo_equals_plain_steps(v4):
    """DBO on: steps split in two microbatches (a prefill chunk cut mid-sequence, decodes split by request) give
    transformers' tokens and logprobs too. Window blocks of 4 tokens: the tail of a cut chunk's first part (read by
    its second part) lies in blocks the chunk's own last W-1 tokens do not reach, so the block manager must give
    them too (whole_chunks); every pool is whole after."""
    hf, d = v4
    llm = LLM(d, block_size=4, max_num_batched_tokens=19, dbo={"enabled": True, "prefill_token_threshold": 2}, **V4)
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.core.stats()["dbo_split_steps"] > 0 and llm.engine.core.blocks.whole_chunks
    _check(hf, outs, PROMPTS, 12)
    assert _empty(llm.engine.core)
    llm.shutdown()


@pytest.mark.parametrize("options,match", [
    (dict(attention_backend="triton"), r"DeepSeek-V4 does not support attention_backend 'triton': DeepSeek-V4 "
                                       r"attention runs on auto / torch / cpu"),
    (dict(experts_backend="triton"), r"DeepSeek-V4 does not support experts_backend 'triton': DeepSeek-V4 experts "
                                     r"\(clamped SwiGLU\) run on the torch or cpu backend"),
    (dict(quantization="fp4"), r"quantization 'fp4' keeps DeepSeek-V4's FP4 experts as stored, but the checkpoint's "
                               r"routed experts are not FP4"),
])
def test_backends_without_v4_kernels_are_refused(v4, options, match):
    hf, d = v4
    with pytest.raises(ValueError, match=match):
        LLM(d, **dict(V4, **options))


@pytest.mark.parametrize("backend,decode,experts,kernels", [("auto", "batched", "cpu", "cpu"),
                                                             ("torch", "ops", "torch", "torch")])
def test_v4_decode_paths(v4, backend, decode, experts, kernels):
    """V4's decode steps run batched on the CPU kernels by default (attention_v4/decode.py; "torch": the reference,
    one sequence at a time); the MLA family's fused decode (engine/model/fused_decode.py) is not built for V4, and the
    engine's metrics say so with a reason (its decode steps counted as declined)."""
    hf, d = v4
    llm = LLM(d, attention_backend=backend, **V4)
    assert llm.model.decode_plan is None and llm.model.backends["decode"] == decode
    assert llm.model.backends["experts"] == experts and llm.model.backends["kernels"] == kernels
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    counts = llm.engine.metrics()["decode_plan"]   # 6 tokens: the prefill's, then 5 decode steps
    if decode == "ops":
        assert counts == {"declined": {"deepseek_v4_layers": 5}}, counts
    else:
        assert counts == {"steps": {"v4_batched": 5}}, counts
    llm.shutdown()
