"""DeepSeek-V4's FP4 routed experts kept packed on the CPU backend (quantization auto / fp4: e2m1 pairs + e8m0
bytes, read in place by the C experts kernel with the clamped SwiGLU) == the same checkpoint dequantised at load
(quantization none, torch experts): prompt logprobs within 1e-4, greedy tokens equal; the packed bytes are the
checkpoint's exactly; EPLB's moves carry them; what cannot keep them packed is refused under 'fp4'."""
from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")

from wideep.cpu.build import unusable
from wideep.engine import LLM, SamplingParams
from wideep.engine.model.families import load_model
from tests.engine.test_v4_quantized import checkpoints  # noqa: F401  (the module fixture: FP8 + FP4 V4 checkpoint)

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)

_rng = random.Random(5)
PROMPTS = [[_rng.randrange(2, 200) for _ in range(n)] for n in (6, 31, 70)]
V4 = dict(dtype="float32", progress=False, enable_prefix_caching=False)


def test_fp4_experts_stay_packed_with_the_checkpoints_bytes(checkpoints):  # noqa: F811
    qdir, _ = checkpoints
    model = load_model(qdir, progress=False)
    assert model.backends["experts"] == "cpu" and model.backends["fp4_experts"]
    with safe_open(os.path.join(qdir, "model.safetensors"), framework="pt") as f:
        for i, layer in enumerate(model.layers):
            ex, I = layer.ffn.experts, layer.ffn.experts.intermediate
            assert ex.w13.dtype == ex.w13_scale_inv.dtype == torch.uint8
            for slot, e in enumerate(layer.ffn.local_phy2log):
                pre = f"layers.{i}.ffn.experts.{e}."
                for w, s, name in ((ex.w13[slot, :I], ex.w13_scale_inv[slot, :I], "w1"),
                                   (ex.w13[slot, I:], ex.w13_scale_inv[slot, I:], "w3"),
                                   (ex.w2[slot], ex.w2_scale_inv[slot], "w2")):
                    assert torch.equal(w, f.get_tensor(pre + name + ".weight").view(torch.uint8)), pre + name
                    assert torch.equal(s, f.get_tensor(pre + name + ".scale").view(torch.uint8)), pre + name
    n = sum(layer.ffn.experts.num_local * 3 * layer.ffn.experts.hidden * layer.ffn.experts.intermediate
            for layer in model.layers)
    assert model.param_bytes()["experts"] / n == 0.5 + 1 / 32     # bytes per routed-expert parameter


def test_packed_equals_dequantised_at_load(checkpoints):  # noqa: F811
    qdir, _ = checkpoints
    params = SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=0, ignore_eos=True)
    outs = {}
    # packed (the C kernel), dequantised at load on torch's experts, and dequantised on the C kernel (float32
    # weights, the clamped SwiGLU in C)
    for key, q, backend in (("fp4", "fp4", "auto"), ("none", "none", "torch"), ("none_cpu", "none", "cpu")):
        llm = LLM(qdir, quantization=q, experts_backend=backend, max_num_batched_tokens=24, **V4)
        assert llm.model.backends["fp4_experts"] == (q == "fp4")
        assert llm.model.backends["experts"] == ("torch" if key == "none" else "cpu")
        outs[key] = llm.generate(PROMPTS, params)
        llm.shutdown()
    for other in ("none", "none_cpu"):
        for ids, a, b in zip(PROMPTS, outs["fp4"], outs[other], strict=True):
            lp = [torch.tensor([o.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))]) for o in (a, b)]
            diff = (lp[0] - lp[1]).abs().max().item()
            assert diff < 1e-4, f"{other}, prompt of {len(ids)} tokens: logprobs differ by {diff}"
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"{other}, prompt of {len(ids)} tokens"


@torch.no_grad()
def test_eplb_moves_carry_the_packed_bytes_and_scales(checkpoints):  # noqa: F811
    """EPLB's weight moves (eplb/transfer.py) pack every stacked expert parameter as raw bytes: the fp4 pairs and
    their e8m0 scales move together, and the experts then compute what the source slot did."""
    from wideep.eplb.transfer import Move, expert_bytes, stage_layer, swap_layer
    qdir, _ = checkpoints
    model = load_model(qdir, progress=False)
    ex = model.layers[1].ffn.experts
    params = list(ex.parameters())
    assert {p.dtype for p in params} == {torch.uint8} and len(params) == 4
    I, H = ex.intermediate, ex.hidden
    assert expert_bytes(params) == 3 * H * I // 2 + 3 * H * I // 32
    x = torch.randn(3, H)
    ids, wts = torch.full((3, 1), 2), torch.ones(3, 1)
    want = ex(x, ids, wts)                                        # slot 2's expert
    before = [p[2].clone() for p in params]
    slots, staged = stage_layer([Move(1, 2, 0, 2, 0, (5,))], params, 0, ctx=None)
    swap_layer(params, slots, staged)
    assert all(torch.equal(p[5], b) for p, b in zip(params, before))
    torch.testing.assert_close(ex(x, torch.full((3, 1), 5), wts), want, rtol=0, atol=0)


def test_fp4_that_cannot_stay_packed_is_refused(checkpoints):  # noqa: F811
    qdir, _ = checkpoints
    with pytest.raises(ValueError, match=r"quantization 'fp4' .* experts_backend 'torch' does not read FP4"):
        load_model(qdir, progress=False, quantization="fp4", experts_backend="torch")
    with pytest.raises(ValueError, match=r"quantization 'fp4' .* not DeepSeek-V4"):
        from wideep.engine.model.build import _apply_quantization
        from wideep.moe.backend import ExpertsChoice
        _apply_quantization("fp4", ExpertsChoice("cpu", keep_fp8=False), None)
    # torch experts on the same checkpoint: dequantised at load, as before
    model = load_model(qdir, progress=False, experts_backend="torch")
    assert model.backends["experts"] == "torch" and not model.backends["fp4_experts"]
    assert model.layers[0].ffn.experts.w13.dtype == torch.float32


def test_the_reader_gives_packed_bytes_and_e8m0_scales_as_stored(checkpoints):  # noqa: F811
    from wideep.engine.model.loader import CheckpointError, CheckpointReader, v4_rename
    from wideep.moe.fp4 import scale_to_e8m0
    qdir, _ = checkpoints
    r = CheckpointReader(qdir, rename=v4_rename)
    name = "layers.2.ffn.experts.3.w2.weight"
    assert r.is_fp4(name) and not r.is_fp4("embed.weight")
    assert r.shape(name) == (64, 32) and r.shape(name, packed=True) == (64, 16)
    assert r.get(name, torch.uint8).dtype == r.get(name + "_scale_inv", torch.uint8).dtype == torch.uint8
    with pytest.raises(CheckpointError, match=r"'embed.weight' is wanted as FP4 pairs \(uint8\), but the checkpoint "
                                              r"stores it as torch.float32"):
        r.get("embed.weight", torch.uint8)
    # scales stored as floats: powers of two become their bytes, anything else is refused
    assert scale_to_e8m0(torch.tensor([1.0, 0.25, 2.0 ** -127, 2.0 ** 127])).tolist() == [127, 125, 0, 254]
    with pytest.raises(ValueError, match=r"an fp4 scale of 0.3 is not a power of two"):
        scale_to_e8m0(torch.tensor([0.5, 0.3]))


def _rank_main(model_dir: str, ep: int) -> dict:
    from wideep.engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    llm = LLM(model_dir, dp_size=ep, ep_size=ep, progress=False, enable_prefix_caching=False,
              max_num_batched_tokens=24, parallel={"timeout_s": 60.0},
              eplb={"enabled": True, "num_redundant_experts": ep, "window_size": 8, "step_interval": 3})
    outs = llm.generate(PROMPTS, sp)
    out = {"fp4": llm.model.backends["fp4_experts"], "rebalances": llm.engine.core.eplb.metrics["rebalances"],
           "tokens": [o.outputs[0].token_ids for o in outs],
           "prompt_lp": [[o.prompt_logprobs[j][o.prompt_token_ids[j]] for j in range(1, len(o.prompt_token_ids))]
                         for o in outs]}
    llm.shutdown()
    return out


@pytest.mark.multirank
def test_fp4_experts_on_2_ep_ranks_with_eplb_moving_them(checkpoints):  # noqa: F811
    """Each rank reads only its experts' pairs and scales; EPLB rebalances while serving, moving the packed bytes
    between ranks: every rank's tokens and prompt logprobs equal the single process's dequantised run."""
    from tests.parallel.spawn import spawn
    qdir, _ = checkpoints
    sp = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, ignore_eos=True)
    llm = LLM(qdir, quantization="none", max_num_batched_tokens=24, **V4)
    single = llm.generate(PROMPTS, sp)
    llm.shutdown()
    ranks = spawn(_rank_main, 2, args=(qdir, 2), timeout_s=300)
    for r in ranks:
        assert r["fp4"] and r["rebalances"] > 0
        for toks, lp, s in zip(r["tokens"], r["prompt_lp"], single, strict=True):
            assert toks == s.outputs[0].token_ids
            want = [s.prompt_logprobs[j][s.prompt_token_ids[j]] for j in range(1, len(s.prompt_token_ids))]
            assert (torch.tensor(lp) - torch.tensor(want)).abs().max() < 1e-4
