"""quantization "fp8" on an unquantised (float32 / bfloat16) checkpoint: quantised at load into DeepSeek's FP8 format
(engine/model/loader.py OnlineFp8Reader) and kept fp8 on the CPU kernels. Against the same weights quantised offline
into an fp8 checkpoint (kv_b_proj left unquantised, as the online path keeps it): every fp8 weight and scale
bit-equal, the same tokens and logprobs; one byte a weight plus a float32 scale per 128 x 128 tile; errors."""
from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers")

from wideep.cpu.build import unusable  # noqa: E402
from wideep.engine import LLM, SamplingParams  # noqa: E402
from wideep.engine.model.families import load_model  # noqa: E402
from wideep.moe.fp8 import FP8_DTYPE  # noqa: E402
from wideep.moe.fp8_linear import Fp8Linear  # noqa: E402
from tests.cpu.test_fp8_e2e import _quantise  # noqa: E402
from tests.oracle import make_hf_model  # noqa: E402

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)

PROMPTS = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [(7 * i + 3) % 200 for i in range(70)]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(the unquantised checkpoint, its offline fp8 copy: every projection but kv_b_proj, and the experts)."""
    plain = str(tmp_path_factory.mktemp("plain"))
    make_hf_model("v3", plain, bias_std=0.1, hidden_size=192, intermediate_size=320, moe_intermediate_size=80,
                  kv_lora_rank=160, q_lora_rank=136, num_attention_heads=4)
    fp8 = str(tmp_path_factory.mktemp("fp8"))
    shutil.copytree(plain, fp8, dirs_exist_ok=True)
    _quantise(fp8, keep=lambda name: "kv_b_proj" in name)
    return plain, fp8


def test_online_fp8_equals_the_offline_checkpoint(dirs):
    plain, fp8 = dirs
    online, offline = (load_model(d, progress=False, quantization="fp8") for d in dirs)
    assert online.backends["fp8_weights"] and offline.backends["fp8_weights"]
    a = online.model.layers[3].self_attn
    assert isinstance(a.o_proj, Fp8Linear) and a.o_proj.weight.dtype == FP8_DTYPE
    assert a.kv_b_proj.weight.dtype == torch.float32
    on, off = dict(online.named_parameters()), dict(offline.named_parameters())
    on.update(online.named_buffers())
    off.update(offline.named_buffers())
    assert on.keys() == off.keys()
    n8 = 0
    for name, t in on.items():
        assert t.dtype == off[name].dtype, name
        if t.dtype == FP8_DTYPE:
            n8 += 1
            assert torch.equal(t.view(torch.uint8), off[name].view(torch.uint8)), name
        else:
            assert torch.equal(t, off[name]), name
    assert n8 >= 4 * 3   # the projections and experts of every layer
    # one byte a weight plus the scales: the float32 model less three bytes a quantised weight
    plain_model = load_model(plain, progress=False)
    n = sum(t.numel() for t in on.values() if t.dtype == FP8_DTYPE)
    scales = sum(t.numel() * 4 for name, t in on.items() if name.endswith("scale_inv"))
    assert online.param_bytes()["total"] == plain_model.param_bytes()["total"] - 3 * n + scales


def test_online_fp8_serves_as_the_offline_checkpoint(dirs):
    res = []
    for d in dirs:
        llm = LLM(d, dtype="float32", progress=False, quantization="fp8")
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True))
        res.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert llm.model.backends["fp8_weights"] and llm.model.decode_plan.steps["stack"] > 0
        llm.shutdown()
    assert res[0] == res[1]


def test_online_fp8_errors(dirs, tmp_path):
    plain, _ = dirs
    with pytest.raises(ValueError, match=r"quantization 'fp8' \(quantised at load\): the experts backend 'grouped' "
                                         r"computes on dequantised weights"):
        load_model(plain, progress=False, quantization="fp8", experts_backend="torch")
    assert load_model(plain, progress=False).backends["fp8_weights"] is False   # auto: as stored
