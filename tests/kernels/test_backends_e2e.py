"""A tiny model served with the Triton experts and the Triton paged decode gives the torch backends'
tokens and logprobs (interpreted kernels on CPU: kept tiny). Also: backend resolution and errors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wideep.engine import LLM, SamplingParams  # noqa: E402
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from wideep.moe.backend import resolve_experts_backend  # noqa: E402
from wideep.moe.fp8_linear import Fp8Linear  # noqa: E402
from wideep.attention_mla.paged_decode import resolve_attention_backend  # noqa: E402

PROMPTS = [[3, 17, 42, 99, 5, 150, 23], [5, 6]]


def _run(model_dir: str, device: str, **backends):
    llm = LLM(model_dir, dtype="float32", device=device, progress=False, block_size=4, kv_cache_blocks=16,
              max_num_seqs=2, **backends)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("fp8", [False, True])
def test_triton_backends_match_torch(tmp_path, fp8, monkeypatch, device):
    import wideep.attention_mla.triton_decode as td
    import wideep.moe.triton_moe as tm
    calls = {"moe": 0, "decode": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper
    monkeypatch.setattr(tm, "fused_moe", counted("moe", tm.fused_moe))
    monkeypatch.setattr(td, "mla_decode", counted("decode", td.mla_decode))
    d = make_tiny_checkpoint(str(tmp_path), "v3", fp8=fp8, num_hidden_layers=2, n_routed_experts=8, n_group=4,
                             topk_group=2, num_experts_per_tok=2, vocab_size=200)
    ref_llm, ref = _run(d, device, experts_backend="torch", attention_backend="torch")
    assert calls == {"moe": 0, "decode": 0}
    llm, got = _run(d, device, experts_backend="triton", attention_backend="triton")
    # prefill of both prompts + 3 decode steps: the 1 MoE layer ran the kernel every step, both attention
    # layers ran the paged decode kernel at every decode step
    assert calls["moe"] == 4 and calls["decode"] == 2 * 3
    assert llm.model.backends == {"experts": "triton", "fp8_weights": fp8, "attention": "triton", "kernels": "torch",
                                  "decode": "ops"}
    assert ref_llm.model.backends["fp8_weights"] is False           # torch dequantises fp8 at load
    experts = llm.model.moe_layers()[0].experts
    assert experts.w13.dtype == (torch.float8_e4m3fn if fp8 else torch.float32)
    attn, dense = llm.model.model.layers[0].self_attn, llm.model.model.layers[0].mlp
    assert isinstance(attn.q_a_proj, Fp8Linear) == fp8 and isinstance(dense.down_proj, Fp8Linear) == fp8
    assert attn.kv_b_proj.weight.dtype == torch.float32          # read directly by both MLA forms
    if fp8:
        assert llm.model.param_bytes()["total"] < 0.5 * ref_llm.model.param_bytes()["total"]
    for (toks, lps), (rtoks, rlps) in zip(got, ref):
        assert toks == rtoks
        for a, b in zip(lps, rlps):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_resolution_rules(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # resolution only reads it; nothing is compiled here
    from wideep.cpu.build import unusable
    f32, bf16 = torch.float32, torch.bfloat16
    cpu_kernels = unusable() is None     # CPU auto: the C kernels (cpu/) when they build, never Triton
    assert resolve_experts_backend("auto", "cpu", f32, None, 64, 32).backend == ("cpu" if cpu_kernels else "grouped")
    # the C kernels read fp8 blocks as stored (csrc/gemm_fp8.c) when the block's K side is whole 16-float vectors
    assert resolve_experts_backend("auto", "cpu", bf16, (128, 128), 7168, 2048).keep_fp8 is cpu_kernels
    assert resolve_experts_backend("auto", "cpu", f32, (128, 8), 64, 32).keep_fp8 is False
    assert resolve_experts_backend("torch", "cpu", f32, (128, 128), 64, 32).keep_fp8 is False
    tri = resolve_experts_backend("triton", "cpu", f32, (128, 128), 64, 32)
    assert (tri.backend, tri.keep_fp8) == ("triton", True)
    assert resolve_attention_backend("auto", "cpu") == ("cpu" if cpu_kernels else "torch")
    assert resolve_attention_backend("triton", "cpu") == "triton"
    api = object()  # any probed API: the remaining checks are about shapes, dtype and device
    with pytest.raises(ValueError, match=r"not CUDA"):
        resolve_experts_backend("deepgemm", "cpu", bf16, (128, 128), 256, 128, deepgemm_api=api)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(80\) must be multiples of 128"):
        resolve_experts_backend("deepgemm", "cpu", bf16, (128, 128), 256, 80, deepgemm_api=api)
    with pytest.raises(ValueError, match="not fp8"):
        resolve_experts_backend("deepgemm", "cpu", bf16, None, 256, 128, deepgemm_api=api)
    with pytest.raises(ValueError, match="writes bf16"):
        resolve_experts_backend("deepgemm", "cpu", f32, (128, 128), 256, 128, deepgemm_api=api)
    with pytest.raises(ValueError, match="not one of"):
        resolve_experts_backend("cutlass", "cpu", f32, None, 64, 32)
    with pytest.raises(ValueError, match="not one of"):
        resolve_attention_backend("flashmla", "cpu")


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_experts_backend("triton", "cpu", torch.float32, None, 64, 32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")
