"""A bfloat16 model on the CPU kernels (dtype "bfloat16": weights and latent cache bfloat16, read as stored
by the C) against transformers in float32 on the same weights (the checkpoint's weights rounded to
bfloat16 first; the router's stay float32, as wideep keeps them): prompt logprob drift and greedy
agreement, printed (pytest -s) and bounded; every decode step on the fused C path (the whole stack, then
layer by layer), on both bfloat16 paths (AVX512-BF16 dot products where the CPU has them, widening)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from wideep.cpu import gemm  # noqa: E402
from wideep.cpu.build import unusable  # noqa: E402
from wideep.engine import LLM, SamplingParams  # noqa: E402
from tests.oracle import hf_greedy, hf_prompt_logprobs, make_hf_model  # noqa: E402

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)

PROMPTS = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [120, 33, 71, 2, 88, 14, 160]]
NEW = 12


def _float32_router(name: str) -> bool:
    return name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(checkpoint dir, transformers model on its weights, its prompt logprobs, its greedy continuations)."""
    d = str(tmp_path_factory.mktemp("bf16"))
    hf = make_hf_model("v3", d, bias_std=0.2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not _float32_router(name):
                p.copy_(p.to(torch.bfloat16))
    hf.save_pretrained(d)
    return d, [hf_prompt_logprobs(hf, ids) for ids in PROMPTS], [hf_greedy(hf, ids, NEW) for ids in PROMPTS]


@pytest.fixture
def amx(monkeypatch):
    """amx(on, c_tiles=False): as if this CPU had AMX tiles or not (cpu/linear.py amx_bf16, which routes bigger
    bfloat16 GEMMs to oneDNN), whatever it has, and the C kernels' own tiles (gemm.amx) on or off; the C
    setting is restored after the test."""
    import wideep.cpu.linear as cpu_linear
    before = gemm.amx()

    def set_(on: bool, c_tiles: bool = False) -> None:
        monkeypatch.setattr(cpu_linear, "_AMX", on)
        assert gemm.amx(c_tiles) == c_tiles
    yield set_
    gemm.amx(before)


TILES = pytest.mark.skipif(not gemm.amx_supported(), reason="this CPU (or its kernel) gives no AMX tiles")


def _drift_and_agreement(outs, ref_lps, ref_greedy) -> tuple[float, int, int]:
    drift, agree, total = 0.0, 0, 0
    for ids, out, ref, greedy in zip(PROMPTS, outs, ref_lps, ref_greedy):
        ours = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        drift = max(drift, (ours - ref).abs().max().item())
        toks = out.outputs[0].token_ids
        agree += next((i for i, (a, b) in enumerate(zip(toks, greedy)) if a != b), len(greedy))
        total += len(greedy)
    return drift, agree, total


@pytest.mark.parametrize("dot", [pytest.param(True, id="dot", marks=pytest.mark.skipif(
    not gemm.bf16_dot_supported(), reason="this CPU has no AVX512-BF16")), pytest.param(False, id="widen"),
    pytest.param("tiles", id="tiles", marks=TILES)])
@pytest.mark.parametrize("stack", [True, False], ids=["stack", "layers"])
def test_bf16_model_vs_transformers_float32(oracle, dot, stack, amx):
    """(Without oneDNN's AMX routing, so that the 21-row prefill runs fused on every machine (every query on the paged
    kernel: attention_mla/mla.py PAGED_STEP_TOKENS); "tiles":
    the dot products with the C kernels' own AMX tiles: GEMMs, routed experts and the paged decode on them.)"""
    amx(False, c_tiles=dot == "tiles")
    d, ref_lps, ref_greedy = oracle
    before = gemm.bf16_dot()
    gemm.bf16_dot(bool(dot))
    try:
        llm = LLM(d, dtype="bfloat16", device="cpu", progress=False, fuse_decode_stack=stack)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, prompt_logprobs=0,
                                                    ignore_eos=True))
    finally:
        gemm.bf16_dot(before)
    model = llm.model
    assert model.backends == {"experts": "cpu", "fp8_weights": False, "attention": "cpu", "kernels": "cpu",
                              "decode": "stack" if stack else "layers"}
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    plan = llm.engine.metrics()["decode_plan"]
    path = "stack" if stack else "layers"
    assert plan["steps"][path] == NEW and plan["steps"]["ops"] == 0, plan   # the prefill and NEW - 1 decodes
    assert not any(plan["declined"].values()), plan
    drift, agree, total = _drift_and_agreement(outs, ref_lps, ref_greedy)
    print(f"\nbf16 {path} {dot if dot == 'tiles' else 'dot' if dot else 'widen'}: prompt logprob max |drift| {drift:.4f} vs transformers "
          f"float32; greedy tokens agreeing before the first difference {agree}/{total}")
    assert drift < 0.1
    assert agree >= total // 2


def test_amx_tiles_take_bf16_steps_past_16_rows_to_onednn(oracle, amx):
    """With AMX tiles the C kernels do not use (cpu/linear.py AMX_BF16_MAX_ROWS): a bfloat16 step of more than 16 rows
    runs the model's operations (its projections on torch's bfloat16 GEMM), counted as too_many_rows; 16 rows and
    fewer stay fused. Same bounds against transformers as the fused run."""
    from wideep.cpu.linear import AMX_BF16_MAX_ROWS, MAX_ROWS, max_rows
    d, ref_lps, ref_greedy = oracle
    amx(True)
    assert max_rows(torch.bfloat16) == AMX_BF16_MAX_ROWS == 16 and max_rows(torch.float32) == MAX_ROWS
    llm = LLM(d, dtype="bfloat16", device="cpu", progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    plan = llm.engine.metrics()["decode_plan"]
    assert plan["declined"]["too_many_rows"] == 1 and plan["steps"]["ops"] == 1, plan   # the 21-row prefill
    assert plan["steps"]["stack"] == NEW - 1, plan                                       # 3-row decodes
    drift, agree, total = _drift_and_agreement(outs, ref_lps, ref_greedy)
    assert drift < 0.1 and agree >= total // 2
    many = [[(7 * i + j) % 190 + 2 for j in range(5)] for i in range(AMX_BF16_MAX_ROWS + 4)]
    llm.generate(many, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    after = llm.engine.metrics()["decode_plan"]
    assert after["steps"]["ops"] - plan["steps"]["ops"] == 3, after   # the 100-row prefill, two 20-row decodes
    amx(False)
    assert max_rows(torch.bfloat16) == MAX_ROWS


@TILES
def test_c_tiles_keep_bf16_steps_fused_up_to_their_row_limit(oracle, amx):
    """With the C kernels on AMX tiles (gemm.amx, cpu/linear.py AMX_TILE_MAX_ROWS): bfloat16 steps of up to 256 rows run
    the fused C calls (a 21-row prefill, 3-row and 20-row decodes as one stack call each), more rows run the
    operations (projections past the limit on oneDNN, the routed experts still on the C tiles). Same bounds against
    transformers as the fused run."""
    from wideep.cpu.linear import AMX_TILE_MAX_ROWS, MAX_ROWS, max_rows
    d, ref_lps, ref_greedy = oracle
    amx(True, c_tiles=True)
    assert max_rows(torch.bfloat16) == AMX_TILE_MAX_ROWS == 256 and max_rows(torch.float32) == MAX_ROWS
    llm = LLM(d, dtype="bfloat16", device="cpu", progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, prompt_logprobs=0, ignore_eos=True))
    plan = llm.engine.metrics()["decode_plan"]
    assert plan["steps"]["mlp_halves"] == 0 and plan["steps"]["ops"] == 0, plan
    assert plan["steps"]["stack"] == NEW, plan   # the 21-row prefill (every query on the paged kernel), the decodes
    drift, agree, total = _drift_and_agreement(outs, ref_lps, ref_greedy)
    assert drift < 0.1 and agree >= total // 2
    many = [[(7 * i + j) % 190 + 2 for j in range(13)] for i in range(20)]
    llm.generate(many, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    after = llm.engine.metrics()["decode_plan"]
    assert after["steps"]["ops"] == 1 and after["declined"]["too_many_rows"] == 1, after   # the 260-row prefill
    assert after["steps"]["stack"] - plan["steps"]["stack"] == 2, after                 # two 20-row decodes
