"""A DeepSeek-V4 checkpoint as DeepSeek publishes it (their tensor names; FP8 e4m3 attention and shared-expert
linears with ue8m0 128x128 block scales `X.scale`; FP4 e2m1 routed experts, two per byte, an e8m0 scale per 32;
the compressor / indexer projections unquantised) is dequantised at load: the model equals transformers run on
the same weights dequantised by the formats' definitions."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from wideep.attention_v4.streams import V4Meta
from wideep.engine.model.families import load_model
from wideep.engine.model.loader import CheckpointReader, v4_rename
from wideep.moe.fp4 import E2M1, dequantize_fp4, pack_fp4
from tests.oracle_v4 import make_v4_model

FP8_MAX = 448.0
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
         "expert_dtype": "fp4"}
FP8_LINEAR = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$")
FP4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
TOP = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
       "hc_head.hc_scale": "hc_head_scale"}


def _pow2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=1e-30))))


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> stored fp8, e8m0 scale [1, 1] (one 128x128 block holds a tiny weight), the weight they mean."""
    s = _pow2(w.abs().max() / FP8_MAX).view(1, 1)
    q = (w / s).to(torch.float8_e4m3fn)
    return q, s.to(torch.float8_e8m0fnu), q.float() * s


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> packed int8 [rows, cols/2], e8m0 scales [rows, cols/32], the weight they mean (nearest e2m1 codes)."""
    rows, cols = w.shape
    s = _pow2(w.view(rows, cols // 32, 32).abs().amax(-1) / 6.0)                 # [rows, cols/32]
    x = w / s.repeat_interleave(32, 1)
    lut = torch.tensor(E2M1)
    codes = (x[..., None] - lut).abs().argmin(-1)                                # nearest value's code
    meant = lut[codes] * s.repeat_interleave(32, 1)
    return pack_fp4(codes).view(torch.int8), s.to(torch.float8_e8m0fnu), meant


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("v4_base"))
    make_v4_model(base)
    saved = load_file(os.path.join(base, "model.safetensors"))
    quant, meant = {}, {}
    for name, w in saved.items():
        ds = name[len("model."):] if name.startswith("model.") else name
        ds = TOP.get(ds, ds)
        if FP8_LINEAR.search(ds) or FP4_EXPERT.search(ds):
            q, s, m = (_fp4 if FP4_EXPERT.search(ds) else _fp8)(w)
            quant[ds], quant[ds[:-len("weight")] + "scale"], meant[name] = q, s, m
        else:
            quant[ds], meant[name] = w, w
    qdir, ddir = str(tmp_path_factory.mktemp("v4_fp8_fp4")), str(tmp_path_factory.mktemp("v4_dequantised"))
    cfg = json.load(open(os.path.join(base, "config.json")))
    save_file(quant, os.path.join(qdir, "model.safetensors"))
    json.dump(dict(cfg, quantization_config=QUANT), open(os.path.join(qdir, "config.json"), "w"))
    save_file(meant, os.path.join(ddir, "model.safetensors"))
    shutil.copy(os.path.join(base, "config.json"), ddir)
    return qdir, ddir


def test_fp4_nibble_order_and_scales():
    codes = torch.tensor([[1, 15, 7, 0] * 8])                                    # 0.5, -6, 6, 0, ...
    packed = pack_fp4(codes)
    assert packed[0, :2].tolist() == [1 | 15 << 4, 7]
    w = dequantize_fp4(packed.view(torch.int8), torch.tensor([[129]], dtype=torch.uint8))   # 2^(129-127) = 4
    assert w[0, :4].tolist() == [2.0, -24.0, 24.0, 0.0]
    with pytest.raises(ValueError, match=r"needs scales \[1, 1\] \(one per 1x32 block\), got \(1, 2\)"):
        dequantize_fp4(packed, torch.ones(1, 2))


def test_reader_dequantises_to_the_meant_weights(checkpoints):
    qdir, ddir = checkpoints
    q, d = CheckpointReader(qdir, rename=v4_rename), CheckpointReader(ddir, rename=v4_rename)
    names = [n for n in q.names if not n.endswith("_scale_inv")]
    assert sorted(names) == sorted(d.names)
    assert any(FP4_EXPERT.search(n) for n in names) and any(FP8_LINEAR.search(n) for n in names)
    for n in names:
        assert q.shape(n) == d.shape(n), n
        want = d.get(n, torch.float32 if d.get(n, torch.float32).is_floating_point() else torch.int64)
        assert torch.equal(q.get(n, want.dtype), want), n


@torch.no_grad()
def test_quantised_checkpoint_equals_transformers_on_its_weights(checkpoints):
    import transformers
    qdir, ddir = checkpoints
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ddir).eval().float()
    model = load_model(qdir, progress=False)
    ids = [(7 * i + 3) % 197 + 2 for i in range(60)]
    ours = model.logits(model(torch.tensor(ids), V4Meta.build([60], [model.new_streams()])))
    ref = hf(torch.tensor([ids])).logits[0]
    assert (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item() < 1e-4


def _logits(model, ids: list[int]) -> torch.Tensor:
    return model.logits(model(torch.tensor(ids), V4Meta.build([len(ids)], [model.new_streams()])))


@torch.no_grad()
def test_fp8_projections_stay_fp8_on_the_cpu_kernels(checkpoints):
    """quantization "auto" on the CPU kernels keeps the five attention projections and the shared expert FP8 as
    stored (read by the fp8 GEMM: one byte a weight plus its scales); "none" and the torch reference dequantise
    them; the logits agree."""
    from wideep.cpu.build import unusable
    if unusable() is not None:
        pytest.skip(f"CPU kernels: {unusable()}")
    from wideep.moe.fp8_linear import Fp8Linear
    qdir, _ = checkpoints
    kept = load_model(qdir, progress=False)
    assert kept.backends["fp8_weights"] and not kept.backends["fp8_online"]
    for layer in kept.layers:
        for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            lin = getattr(layer.attn, name)
            assert isinstance(lin, Fp8Linear) and lin.weight.dtype == torch.float8_e4m3fn, name
        assert isinstance(layer.ffn.shared_experts.gate_proj, Fp8Linear)
        if layer.attn.compressor is not None:   # the compressor's projections stay as stored (unquantised)
            assert not isinstance(layer.attn.compressor.wkv, Fp8Linear)
    ids = [(7 * i + 3) % 197 + 2 for i in range(40)]
    for other in (load_model(qdir, progress=False, quantization="none"),
                  load_model(qdir, progress=False, attention_backend="torch")):
        assert not other.backends["fp8_weights"]
        diff = (_logits(kept, ids).log_softmax(-1) - _logits(other, ids).log_softmax(-1)).abs().max().item()
        assert diff < 1e-4, diff


def _quantise_offline(src: str, dst: str) -> None:
    """src's checkpoint with the projections DeepSeek stores in FP8 quantised as online FP8 does (moe/fp8.py
    quantize_fp8_block, 128 x 128 tiles, float32 scales `X.scale`), in DeepSeek's names."""
    from wideep.moe.fp8 import quantize_fp8_block
    out = {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        ds = name[len("model."):] if name.startswith("model.") else name
        ds = TOP.get(ds, ds)
        if FP8_LINEAR.search(ds):
            out[ds], out[ds[:-len("weight")] + "scale"] = quantize_fp8_block(w.float(), (128, 128))
        else:
            out[ds] = w
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump(dict(cfg, quantization_config=dict(QUANT, scale_fmt="float", expert_dtype="fp8")),
              open(os.path.join(dst, "config.json"), "w"))


@torch.no_grad()
def test_online_fp8_equals_the_same_quantisation_offline(checkpoints, tmp_path):
    """quantization "fp8" on the unquantised checkpoint: the FP8 projections quantised at load equal a checkpoint
    quantised beforehand in the same format, bit for bit; everything else is the float32 checkpoint's."""
    from wideep.cpu.build import unusable
    if unusable() is not None:
        pytest.skip(f"CPU kernels: {unusable()}")
    _, ddir = checkpoints
    offline = str(tmp_path)
    _quantise_offline(ddir, offline)
    online = load_model(ddir, progress=False, quantization="fp8")
    stored = load_model(offline, progress=False)
    assert online.backends["fp8_online"] and online.backends["fp8_weights"] and stored.backends["fp8_weights"]
    for a, b in zip(online.layers, stored.layers):
        for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            assert torch.equal(getattr(a.attn, name).weight.view(torch.uint8), getattr(b.attn, name).weight.view(
                torch.uint8)), name
            assert torch.equal(getattr(a.attn, name).weight_scale_inv, getattr(b.attn, name).weight_scale_inv), name
    ids = [(5 * i + 1) % 197 + 2 for i in range(30)]
    assert torch.equal(_logits(online, ids), _logits(stored, ids))


def test_fp8_without_the_cpu_kernels_is_refused(checkpoints):
    _, ddir = checkpoints
    with pytest.raises(ValueError, match=r"quantization 'fp8' keeps the FP8 projections on the cpu kernels' fp8 "
                                         r"GEMM, but attention_backend 'torch' computes on dequantised weights"):
        load_model(ddir, progress=False, quantization="fp8", attention_backend="torch")
