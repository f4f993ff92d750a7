"""An FP8 block-quantised checkpoint (DeepSeek-V3's format: e4m3 weights + a float32 `weight_scale_inv` per
128 x 128 block, dims that are not multiples of 128 included) kept as stored on the CPU kernels
(quantization "auto") against the same checkpoint dequantised at load into float32 (quantization "none"):
prompt logprobs within float32 rounding, greedy tokens equal, every decode step on the fused C path (the
whole stack, then layer by layer); the weights' bytes counted exactly from the
modules' tensors (one byte a weight plus the scales); the option's errors."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from wideep.cpu.build import unusable  # noqa: E402
from wideep.engine import LLM, SamplingParams  # noqa: E402
from wideep.engine.model.families import load_model  # noqa: E402
from wideep.moe.fp8 import FP8_DTYPE, quantize_fp8_block  # noqa: E402
from wideep.moe.fp8_linear import Fp8Linear  # noqa: E402
from tests.oracle import make_hf_model  # noqa: E402

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)

# the last prompt is longer than cpu/linear.py MAX_ROWS: its prefill runs BLAS on weights dequantised per call
PROMPTS = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [120, 33, 71, 2, 88, 14, 160],
           [(7 * i + 3) % 200 for i in range(70)]]
NEW = 12


def _quantised(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek-V3's checkpoint stores as fp8: every projection's weight (kv_b_proj too), not the
    embeddings, lm_head, norms or the router."""
    return (t.dim() == 2 and name.endswith(".weight") and "layernorm" not in name and "embed" not in name
            and "lm_head" not in name and not name.endswith("mlp.gate.weight"))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fp8"))
    make_hf_model("v3", d, bias_std=0.1, hidden_size=192, intermediate_size=320, moe_intermediate_size=80,
                  kv_lora_rank=160, q_lora_rank=136, num_attention_heads=4)
    return _quantise(d)


def _quantise(d: str, keep=lambda name: False) -> str:
    """The checkpoint in d (one model.safetensors) rewritten in DeepSeek-V3's fp8 format, 128 x 128 blocks (a weight
    that keep(name) names stays unquantised)."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(d, "model.safetensors")
    out = {}
    for name, t in load_file(path).items():
        if _quantised(name, t) and not keep(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t, (128, 128))
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return d


def _run(d: str, quantization: str, **kw):
    llm = LLM(d, dtype="float32", device="cpu", progress=False, quantization=quantization, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, prompt_logprobs=0, logprobs=3,
                                                ignore_eos=True))
    lps = [torch.tensor([o.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))]) for ids, o in zip(PROMPTS, outs)]
    return llm, lps, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def dequantised(fp8_dir):
    return _run(fp8_dir, "none")


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "layers"])
def test_fp8_kept_equals_dequantised_at_load(fp8_dir, dequantised, stack):
    kept, lps8, toks8 = _run(fp8_dir, "auto", fuse_decode_stack=stack)
    deq, lps32, toks32 = dequantised
    m8, m32 = kept.model, deq.model
    assert m8.backends["fp8_weights"] and m8.backends["experts"] == "cpu" and m8.backends["kernels"] == "cpu"
    assert not m32.backends["fp8_weights"]
    a8, a32 = m8.model.layers[3].self_attn, m32.model.layers[3].self_attn
    assert isinstance(a8.o_proj, Fp8Linear) and a8.o_proj.weight.dtype == FP8_DTYPE and a8.o_proj.backend == "kernel"
    assert a32.o_proj.weight.dtype == torch.float32
    assert m8.model.layers[3].mlp.experts.w13.dtype == FP8_DTYPE
    for a, b in zip(lps8, lps32):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for (t8, d8), (t32, d32) in zip(toks8, toks32):   # greedy tokens and each decode step's top-3 logprobs
        assert t8 == t32
        for a, b in zip(d8, d32):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4
    # every decode step ran fused over the fp8 weights (fused.Fp8Mat), the prefills as operations
    plan = m8.decode_plan
    assert not plan.unfit and not plan.moe_unfit
    path = "stack" if stack else "layers"
    assert plan.steps[path] == NEW - 1 and plan.steps["ops"] + plan.steps["mlp_halves"] == 1, plan.steps


def _fp8_bytes(model) -> tuple[int, int, int]:
    """(weights kept as fp8, their bytes, their scales' bytes), from the modules' tensors."""
    n = wbytes = sbytes = 0
    for m in model.modules():
        for w, s in ((getattr(m, "weight", None), getattr(m, "weight_scale_inv", None)),
                     (getattr(m, "w13", None), getattr(m, "w13_scale_inv", None)),
                     (getattr(m, "w2", None), getattr(m, "w2_scale_inv", None))):
            if isinstance(w, torch.Tensor) and w.dtype == FP8_DTYPE:
                n += w.numel()
                wbytes += w.numel() * w.element_size()
                sbytes += s.numel() * s.element_size()
    return n, wbytes, sbytes


def test_fp8_weights_take_one_byte_each_plus_scales(fp8_dir):
    kept = load_model(fp8_dir, progress=False, quantization="auto")
    deq = load_model(fp8_dir, progress=False, quantization="none")
    n, wbytes, sbytes = _fp8_bytes(kept)
    assert wbytes == n                                     # one byte a weight
    blocks = 0                                             # one float32 scale per 128 x 128 block (edges partial)
    for m in kept.modules():
        if isinstance(m, Fp8Linear):
            blocks += -(-m.out_features // 128) * -(-m.in_features // 128)
        elif getattr(m, "fp8_block", None) is not None:    # routed experts: gate and up apart, then down
            H, I = m.hidden, m.intermediate
            blocks += m.num_local * (2 * -(-I // 128) * -(-H // 128) + -(-H // 128) * -(-I // 128))
    assert sbytes == 4 * blocks
    total8, total32 = kept.param_bytes()["total"], deq.param_bytes()["total"]
    # the same parameters less 3 bytes a kept weight, plus the scales
    assert total8 == total32 - 3 * n + sbytes
    print(f"\nfp8 kept: {n} weights in {wbytes} B + {sbytes} B of scales; model {total8} B vs {total32} B float32")


def test_the_quantization_option_errors(fp8_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization 'bogus' is not one of"):
        load_model(fp8_dir, progress=False, quantization="bogus")
    with pytest.raises(ValueError, match="experts backend 'grouped' computes on dequantised weights"):
        load_model(fp8_dir, progress=False, quantization="fp8", experts_backend="torch")
    plain = str(tmp_path / "plain")
    make_hf_model("v3", plain)
    assert load_model(plain, progress=False, quantization="fp8").backends["fp8_weights"]   # quantised at load
    assert load_model(plain, progress=False, quantization="none").backends["fp8_weights"] is False


def _ep_rank(model_dir: str, ep: int) -> dict:
    llm = LLM(model_dir, dtype="float32", dp_size=ep, ep_size=ep, progress=False, quantization="auto",
              parallel={"timeout_s": 60.0})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, prompt_logprobs=0, ignore_eos=True))
    res = {"fp8": llm.model.backends["fp8_weights"], "experts_bytes": llm.model.param_bytes()["experts"],
           "tokens": [o.outputs[0].token_ids for o in outs],
           "lps": [[o.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))] for ids, o in zip(PROMPTS, outs)],
           "plan": dict(llm.model.decode_plan.steps)}
    llm.shutdown()
    return res


@pytest.mark.multirank
def test_fp8_experts_sharded_over_two_ep_ranks(fp8_dir, dequantised):
    """Two gloo ranks, each holding half the fp8 experts (and their scales): the single process's results, the
    decode steps on the fused attention halves with the all-to-all between them."""
    from tests.parallel.spawn import spawn
    single = load_model(fp8_dir, progress=False, quantization="auto").param_bytes()["experts"]
    _, lps32, toks32 = dequantised
    for r in spawn(_ep_rank, 2, args=(fp8_dir, 2), timeout_s=240):
        assert r["fp8"] and 2 * r["experts_bytes"] == single
        assert r["tokens"] == [t for t, _ in toks32]
        for a, b in zip(r["lps"], lps32):
            torch.testing.assert_close(torch.tensor(a), b, atol=1e-4, rtol=1e-4)
        assert r["plan"]["layers"] > 0 and r["plan"]["stack"] == 0


def test_fp8_mtp_drafter_keeps_fp8_and_greedy_equals_no_speculation(tmp_path):
    """An fp8 checkpoint with an MTP layer (launch/tiny/cycle.py): the drafter's decoder layer keeps fp8 too, and
    speculative decoding with its drafts gives the tokens of no speculation."""
    from wideep.launch.tiny.cycle import make_cycle_checkpoint
    from tests.engine.test_mtp import cycle_prompts
    d, nxt = make_cycle_checkpoint(str(tmp_path), period=12, mix=2.0, gain=20.0, seed=1, mtp=True, mtp_mix=0.1)
    _quantise(d)
    prompts = cycle_prompts(nxt, 3)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = LLM(d, progress=False, block_size=16, kv_cache_blocks=64).generate(prompts, sp)
    llm = LLM(d, progress=False, block_size=16, kv_cache_blocks=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.model.backends["fp8_weights"]
    assert isinstance(llm.engine.core.loaded.draft.layer.self_attn.o_proj, Fp8Linear)
    got = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.metrics()["spec_decode_acceptance_rate"] > 0
