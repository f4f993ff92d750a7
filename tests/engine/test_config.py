"""config.json parsing: both RoPE spellings, published extra keys, defaults per architecture."""
from __future__ import annotations

import pytest

from wideep.engine.model.model_config import ConfigError, ModelConfig
from wideep.launch.tiny.checkpoint import tiny_config


def test_rope_scaling_and_rope_parameters_agree():
    old = tiny_config("v3")
    new = dict(old)
    rs = dict(new.pop("rope_scaling"))
    rs["rope_type"] = rs.pop("type")
    rs["rope_theta"] = new.pop("rope_theta")
    new["rope_parameters"] = rs
    a, b = ModelConfig.from_dict(old), ModelConfig.from_dict(new)
    assert a.mla.rope == b.mla.rope and a.mla.rope.kind == "yarn" and a.mla.rope.factor == 4.0


def test_published_extra_keys_accepted():
    c = tiny_config("v3")
    c.update(auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, ep_size=1, aux_loss_alpha=0.001,
             seq_aux=True, torch_dtype="bfloat16", num_nextn_predict_layers=1)
    cfg = ModelConfig.from_dict(c)
    assert cfg.num_nextn_predict_layers == 1


def test_v3_defaults_when_transformers_omits_routing_fields():
    c = tiny_config("v3")
    del c["topk_method"], c["scoring_func"]
    moe = ModelConfig.from_dict(c).moe
    assert (moe.topk_method, moe.scoring_func) == ("noaux_tc", "sigmoid")


def test_layer_kinds():
    cfg = ModelConfig.from_dict(tiny_config("v2", num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2))
    assert cfg.moe_layers == [2, 4]


def test_q_lora_null_and_fp8_block():
    c = tiny_config("v2")
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 64]}
    cfg = ModelConfig.from_dict(c)
    assert cfg.mla.q_lora_rank is None and cfg.quant.weight_block_size == (128, 64)


@pytest.mark.parametrize("edit,match", [
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"num_experts_per_tok": 40}, "num_experts_per_tok"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"architectures": ["MixtralForCausalLM"]}, "MixtralForCausalLM"),
])
def test_errors_name_the_field(edit, match):
    c = tiny_config("v3")
    c.update(edit)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(c)
