"""Every bad input the DeepSeek-V4 pieces handle gets an error naming it."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.config import RopeConfig
from wideep.attention_v4.config import V4AttentionConfig
from wideep.attention_v4.streams import V4Meta
from wideep.engine.model.model_config import ModelConfig
from wideep.engine.model.v4_config import V4Config
from wideep.moe.config import MoEConfig
from wideep.moe.experts import Experts
from wideep.moe.fp4 import dequantize_fp4
from wideep.moe.gate import Gate
from wideep.moe.layer import ExpertShard
from tests.engine.test_v4_config import DEEPSEEK

ROPE = RopeConfig(dim=8)
ATT = dict(hidden_size=64, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8,
           sliding_window=8, rope_main=ROPE, rope_compress=ROPE, index_head_dim=16)


@pytest.mark.parametrize("change,match", [
    (dict(sliding_window=0), r"sliding_window to be an int >= 1, got 0"),
    (dict(index_topk=True), r"index_topk to be an int >= 1, got True"),
    (dict(rope_dim=40), r"rope dim \(40\) must be even and at most head_dim \(32\)"),
])
def test_attention_config(change, match):
    with pytest.raises(ValueError, match=match):
        V4AttentionConfig(**dict(ATT, **change))


def test_v4_config_kinds():
    att = V4AttentionConfig(**ATT)
    with pytest.raises(ValueError, match=r"2 layer kinds for 3 MLP kinds"):
        V4Config(att, ("sliding", "csa"), (True, False, False))
    with pytest.raises(ValueError, match=r"layer kinds \['full'\] are not among"):
        V4Config(att, ("full",), (True,))


def test_moe_config_limit():
    with pytest.raises(ValueError, match=r"swiglu_limit must be > 0 or None, got 0"):
        MoEConfig(64, 32, 8, 1, 2, swiglu_limit=0)


def test_hash_gate():
    cfg = MoEConfig(64, 32, 8, 1, 2, scoring_func="sqrtsoftplus", norm_topk_prob=True)
    gate = Gate(cfg, hash_vocab=10)
    gate.weight.data.normal_()
    with pytest.raises(ValueError, match="a hash-routed gate needs the tokens' ids"):
        gate(torch.randn(3, 64))
    gate.tid2eid.copy_(torch.arange(20).view(10, 2) % 8)
    ids, w = gate(torch.randn(3, 64), torch.tensor([0, 4, 9]))
    assert ids.tolist() == [[0, 1], [0, 1], [2, 3]] and torch.allclose(w.sum(-1), torch.ones(3))
    from wideep.layers import Kernels
    with pytest.raises(ValueError, match="a hash-routed gate takes no route kernel"):
        Gate(cfg, kernels=Kernels(route=lambda *a: None), hash_vocab=10)


def test_clamped_experts_only_on_torch():
    with pytest.raises(ValueError, match=r"experts backend 'triton' has no clamped SwiGLU \(swiglu_limit 1.0\)"):
        Experts(2, 8, 4, backend="triton", limit=1.0)
    e = Experts(2, 8, 4, backend="grouped", limit=0.5)
    e.w13.data.normal_(std=3.0)
    e.w2.data.normal_()
    x, ids, w = torch.randn(5, 8), torch.tensor([[0, 1]] * 5), torch.ones(5, 2)
    grouped = e(x, ids, w)
    e.backend = "reference"
    assert torch.allclose(grouped, e(x, ids, w), atol=1e-5)
    e.limit = None
    assert not torch.allclose(grouped, e(x, ids, w), atol=1e-3)


def test_fp4_dtype():
    with pytest.raises(ValueError, match=r"an FP4 weight is a 2-D int8/uint8 tensor of packed pairs, got torch.f"):
        dequantize_fp4(torch.zeros(2, 16), torch.ones(2, 1))


def test_meta():
    with pytest.raises(ValueError, match=r"2 chunk lengths for 1 sequences"):
        V4Meta.build([1, 2], [None])
    with pytest.raises(ValueError, match=r"a sequence's chunk must have at least one token, got 0"):
        V4Meta.build([0], [None])


def test_model_inputs(tmp_path):
    from wideep.engine.model.v4_model import DeepseekV4Model
    cfg = ModelConfig.from_dict(DEEPSEEK)
    with pytest.raises(ValueError, match=r"DeepseekV4Model needs a DeepSeek-V4 config, got arch 'v3'"):
        from wideep.launch.tiny.checkpoint import tiny_config
        DeepseekV4Model(ModelConfig.from_dict(tiny_config("v3")))
    unwired = DeepseekV4Model(cfg, shard=ExpertShard(8, 0, 2))
    with pytest.raises(RuntimeError, match=r"holds 4 of 8 expert slots \(EP rank 0 of 2\) and no dispatcher"):
        unwired(torch.tensor([1, 2]), V4Meta.build([2], [unwired.new_streams()]))
    from wideep.moe.backend import ExpertsChoice
    with pytest.raises(ValueError, match=r"runs its experts on the torch or cpu backend .* not 'triton'"):
        DeepseekV4Model(cfg, experts=ExpertsChoice("triton", keep_fp8=False))
    with pytest.raises(ValueError, match=r"FP4 experts are read as stored by the cpu experts kernel only, not 'grouped'"):
        DeepseekV4Model(cfg, experts=ExpertsChoice("grouped", keep_fp8=False, keep_fp4=True))
    m = DeepseekV4Model(cfg)
    st = m.new_streams()
    with pytest.raises(ValueError, match=r"3 tokens for chunks of 2"):
        m(torch.tensor([1, 2, 3]), V4Meta.build([2], [st]))
    with pytest.raises(ValueError, match=r"keeps its KV in the streams of meta: no pools"):
        m(torch.tensor([1, 2]), V4Meta.build([2], [st]), kv_pools=[torch.zeros(4, 8)])
