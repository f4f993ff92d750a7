"""A tiny model served with the CPU kernels (experts_backend / attention_backend "cpu") gives the torch
backends' tokens and logprobs, with the kernels counted as actually called; "auto" picks them on CPU
for float32 and not for bfloat16; an explicit "cpu" that cannot run says why."""
from __future__ import annotations

import pytest
import torch

from wideep.cpu import fused, gemm, layers
from wideep.cpu.build import unusable
from wideep.engine import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from wideep.moe.backend import resolve_experts_backend
from wideep.attention_mla.paged_decode import resolve_attention_backend

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)

PROMPTS = [[3, 17, 42, 99, 5, 150, 23], [5, 6], [7, 8, 9, 10]]


def _run(model_dir: str, **backends):
    llm = LLM(model_dir, dtype="float32", device="cpu", progress=False, block_size=4, kv_cache_blocks=24,
              max_num_seqs=3, **backends)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_cpu_backends_match_torch(tmp_path, monkeypatch):
    calls = {"experts": 0, "moe_layer": 0, "mla_decode": 0, "mla_layer": 0, "decode_stack": 0, "linear": 0}

    def counted(module, name):
        fn = getattr(module, name)

        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        monkeypatch.setattr(module, name, wrapper)
    for module, name in ((gemm, "experts"), (layers, "mla_decode"), (fused, "mla_layer"), (fused, "moe_layer"),
                         (fused, "decode_stack"), (gemm, "linear")):
        counted(module, name)
    d = make_tiny_checkpoint(str(tmp_path), "v3", num_hidden_layers=2, n_routed_experts=8, n_group=4, topk_group=2,
                             num_experts_per_tok=2, vocab_size=200)
    ref_llm, ref = _run(d, experts_backend="torch", attention_backend="torch")
    assert calls == {"experts": 0, "moe_layer": 0, "mla_decode": 0, "mla_layer": 0, "decode_stack": 0, "linear": 0}
    assert ref_llm.model.backends == {"experts": "torch", "fp8_weights": False, "attention": "torch",
                                      "kernels": "torch", "decode": "ops"}
    assert ref_llm.model.decode_plan is None
    llm, got = _run(d)                                   # auto on CPU, float32: the kernels
    assert llm.model.backends == {"experts": "cpu", "fp8_weights": False, "attention": "cpu", "kernels": "cpu",
                                  "decode": "stack"}
    plan = llm.engine.metrics()["decode_plan"]
    assert plan["steps"] == {"stack": 5, "layers": 0, "mlp_halves": 0, "ops": 0}
    assert sum(plan["declined"].values()) == 0
    # prefill (one step, 13 tokens: every query on the paged kernel, attention_mla/mla.py PAGED_STEP_TOKENS) and 4
    # decode steps: both layers, attention and MoE or dense MLP halves, as one C call a step
    assert calls["decode_stack"] == 5 and calls["moe_layer"] == 0 and calls["experts"] == 0
    assert calls["mla_layer"] == 0 and calls["mla_decode"] == 0 and calls["linear"] > 0
    # the same engine with the whole-step call off: every step's attention halves one call each (the prefill too)
    calls.update({n: 0 for n in calls})
    llm.model.decode_plan.fuse_stack = False
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))
    assert calls["decode_stack"] == 0 and calls["moe_layer"] == 5 and calls["mla_layer"] == 2 * 5
    assert llm.model.backends["decode"] == "layers" and llm.model.decode_plan.stack_declined["disabled"] == 5
    for o, (toks, lps) in zip(outs, got):   # (bit-equality per step: tests/engine/test_fused_decode.py; here the
        assert o.outputs[0].token_ids == toks   # prompts now hit the prefix cache, so the prefills differ)
        for a, b in zip(o.outputs[0].logprobs, lps):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-5
    for (toks, lps), (rtoks, rlps) in zip(got, ref):
        assert toks == rtoks
        for a, b in zip(lps, rlps):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_resolution():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert resolve_experts_backend("auto", "cpu", f32, None, 64, 32).backend == "cpu"
    assert resolve_experts_backend("auto", "cpu", bf16, None, 64, 32).backend == "cpu"
    assert resolve_experts_backend("auto", "cpu", f16, None, 64, 32).backend == "grouped"
    assert resolve_experts_backend("torch", "cpu", f32, None, 64, 32).backend == "grouped"
    fp8 = resolve_experts_backend("cpu", "cpu", f32, (128, 128), 64, 32)
    assert (fp8.backend, fp8.keep_fp8) == ("cpu", True)        # fp8 checkpoints stay fp8 (csrc/gemm_fp8.c)
    assert resolve_attention_backend("auto", "cpu", f32) == "cpu"
    assert resolve_attention_backend("auto", "cpu", bf16) == "cpu"
    assert resolve_attention_backend("auto", "cpu", f16) == "torch"
    assert resolve_attention_backend("torch", "cpu", f32) == "torch"
    with pytest.raises(ValueError, match="experts_backend 'cpu' is not usable: the model dtype is torch.float16"):
        resolve_experts_backend("cpu", "cpu", f16, None, 64, 32)
    with pytest.raises(ValueError, match="attention_backend 'cpu' is not usable: the device is meta, not the CPU"):
        resolve_attention_backend("cpu", "meta", f32)
