"""DeepSeek-V4 config.json in both spellings: DeepSeek's (compress_ratios, num_hash_layers, qk_rope_head_dim,
rope_scaling for the compress table) parses to the same config as what transformers 5.24 writes for the same
model; every bad field is named."""
from __future__ import annotations

import pytest

from wideep.engine.model.model_config import ConfigError, ModelConfig

DEEPSEEK = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=200, hidden_size=64,
                moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=48,
                n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16, sliding_window=8,
                index_n_heads=8, index_head_dim=16, index_topk=4, compress_ratios=[0, 4, 128, 4, 0],  # + MTP's
                num_hash_layers=2, qk_rope_head_dim=16, rope_theta=10000.0, compress_rope_theta=160000.0,
                rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                              "beta_fast": 32, "beta_slow": 1}, routed_scaling_factor=1.5, swiglu_limit=10.0,
                hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, scoring_func="sqrtsoftplus", max_position_embeddings=4096,
                num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1)


def test_deepseek_spelling():
    cfg = ModelConfig.from_dict(DEEPSEEK)
    v4 = cfg.v4
    assert cfg.arch == "v4" and cfg.mla is None and v4.layer_kinds == ("sliding", "csa", "hca", "csa")
    assert v4.hash_layers == (True, True, False, False)
    a = v4.attention
    assert (a.rope_dim, a.csa_ratio, a.hca_ratio, a.sliding_window) == (16, 4, 128, 8)
    assert a.rope_main.kind == "default" and a.rope_main.theta == 10000.0
    c = a.rope_compress
    assert (c.kind, c.theta, c.factor, c.original_max_position) == ("yarn", 160000.0, 16, 65536)
    assert c.attention_factor == 1.0
    m = cfg.moe
    assert (m.scoring_func, m.topk_method, m.n_group, m.norm_topk_prob, m.swiglu_limit) == (
        "sqrtsoftplus", "noaux_tc", 1, True, 10.0)
    assert cfg.intermediate_size == 32 and cfg.is_moe_layer(0) and cfg.moe_layers == [0, 1, 2, 3]


def test_transformers_spelling_is_the_same_model():
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in DEEPSEEK.items() if k not in ("architectures", "model_type", "rope_scaling")}
    raw["rope_parameters"] = DEEPSEEK["rope_scaling"] | {"rope_type": "yarn"}
    del raw["rope_parameters"]["type"]
    written = transformers.DeepseekV4Config(**raw).to_dict()
    assert "compress_ratios" not in written and "layer_types" in written
    written["architectures"] = ["DeepseekV4ForCausalLM"]
    assert ModelConfig.from_dict(written) == ModelConfig.from_dict(DEEPSEEK)


def test_defaults_are_the_pro_order():
    raw = {k: v for k, v in DEEPSEEK.items() if k not in ("compress_ratios", "num_hash_layers")}
    cfg = ModelConfig.from_dict(dict(raw, num_hidden_layers=5))
    assert cfg.v4.layer_kinds == ("hca", "hca", "hca", "csa", "hca")
    assert cfg.v4.hash_layers == (True,) * 3 + (False,) * 2


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=["sliding_attention"] * 3), r"'layer_types' must list one of .* each of the 4 layers"),
    (dict(layer_types=["sliding_attention"] * 3 + ["full_attention"]), r"'layer_types' must list"),
    (dict(compress_ratios=[0, 4]), r"'compress_ratios' must list an int for each of the 4 layers"),
    (dict(compress_ratios=[0, 4, 128, 64]), r"one HCA ratio .* got \[64, 128\]"),
    (dict(compress_rates={"compressed_sparse_attention": 0}), r"'compress_rates.compressed_sparse_attention' must be"),
    (dict(mlp_layer_types=["hash_moe", "dense", "moe", "moe"]), r"'mlp_layer_types' must list 'hash_moe' or 'moe'"),
    (dict(quantization_config={"quant_method": "awq"}), r"'quantization_config.quant_method' must be 'fp8'"),
    (dict(quantization_config={"quant_method": "fp8", "expert_dtype": "int4"}),
     r"'quantization_config.expert_dtype' = 'int4' is not supported"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128]}), r"weight_block_size' must be two"),
    (dict(n_shared_experts=2), r"'n_shared_experts' must be 1, got 2"),
    (dict(num_key_value_heads=2), r"'num_key_value_heads' must be 1"),
    (dict(swiglu_limit=-1), r"'swiglu_limit' must be a number > 0 or null, got -1"),
    (dict(o_groups=3), r"num_attention_heads \(4\) must be divisible by o_groups \(3\)"),
    (dict(rope_scaling={"type": "longrope", "factor": 2}), r"'rope_scaling.rope_type' = 'longrope' is not supported"),
    (dict(rope_scaling={"type": "yarn"}), r"'rope_scaling' needs 'factor' and 'original_max_position_embeddings'"),
    (dict(qk_rope_head_dim=7), r"rope dim \(7\) must be even"),
    (dict(index_head_dim=8), r"index_head_dim \(8\) must be at least that"),
    (dict(hidden_act="gelu"), r"'hidden_act' = 'gelu' is not supported"),
    (dict(scoring_func="relu"), r"scoring_func 'relu' is not supported"),
])
def test_bad_fields_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(dict(DEEPSEEK, **change))
