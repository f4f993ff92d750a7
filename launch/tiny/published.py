"""The published config.json of DeepSeek-V3, DeepSeek-V2-Lite and DeepSeek-V4-Flash, and their truncation to the
first N layers (launch/tiny/shaped.py writes random checkpoints of these shapes).

Sources (values as the model repos' config.json hold them):
  deepseek-v3        huggingface.co/deepseek-ai/DeepSeek-V3 config.json; every size also equals transformers 5.25's
                     DeepseekV3Config defaults (configuration_deepseek_v3.py), which document that model.
  deepseek-v2-lite   huggingface.co/deepseek-ai/DeepSeek-V2-Lite config.json (as transcribed in public model cards
                     and tests: hidden 2048, 27 layers, 64 experts of 1408, 2 shared, top-6, greedy, no q_lora).
  deepseek-v4-flash  huggingface.co/deepseek-ai/DeepSeek-V4-Flash config.json (DeepSeek's spelling: compress_ratios,
                     num_hash_layers, rope_scaling for the compressed branch); the sizes equal transformers 5.25's
                     DeepseekV4Config defaults (configuration_deepseek_v4.py, "deepseek-ai/DeepSeek-V4-Flash-Base").
Not reproduced: `auto_map` (remote-code class paths) and `transformers_version`.
"""
from __future__ import annotations

import copy
from typing import Any

_YARN_V3 = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}

PUBLISHED: dict[str, dict[str, Any]] = {
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_scaling": dict(_YARN_V3), "rope_theta": 10000, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
        "vocab_size": 129280},
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": dict(_YARN_V3, mscale=0.707, mscale_all_dim=0.707), "rope_theta": 10000,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
        "vocab_size": 102400},
    "deepseek-v4-flash": {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
        "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
        "initializer_range": 0.02, "max_position_embeddings": 1048576, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
        "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
        "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
        # 43 layers (2 sliding-window, then CSA 4 / HCA 128 alternating, CSA last) + the MTP block's 0
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]},
}
LIKES = tuple(PUBLISHED)


def published_config(like: str) -> dict[str, Any]:
    """A copy of the published config.json of `like` (one of LIKES)."""
    if like not in PUBLISHED:
        raise ValueError(f"--like {like!r} is not a known model; known: {', '.join(LIKES)}")
    return copy.deepcopy(PUBLISHED[like])


def truncated_config(like: str, layers: int) -> dict[str, Any]:
    """The published config with its first `layers` decoder layers, their types as published (V3's first 3 dense,
    V4's attention kinds and hash-routed layers). No multi-token-prediction layers are kept: the generator writes
    none, so num_nextn_predict_layers is 0."""
    c = published_config(like)
    total = c["num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
        raise ValueError(f"--layers {layers!r}: {like} has {total} layers; give 1..{total}")
    c["num_hidden_layers"] = layers
    if "num_nextn_predict_layers" in c:
        c["num_nextn_predict_layers"] = 0
    if "compress_ratios" in c:
        c["compress_ratios"] = c["compress_ratios"][:layers]
    if "first_k_dense_replace" in c:   # the same layer types; wideep refuses a value above num_hidden_layers
        c["first_k_dense_replace"] = min(c["first_k_dense_replace"], layers)
    return c


def layer_kinds(c: dict[str, Any]) -> list[str]:
    """[L] each layer's published type, for reports and tests: "dense" | "moe" (V2/V3); V4:
    "<sliding|csa|hca>+<hash_moe|moe>"."""
    n = c["num_hidden_layers"]
    if "compress_ratios" in c:
        att = {0: "sliding", 4: "csa", 128: "hca"}
        return [f"{att[r]}+{'hash_moe' if i < c['num_hash_layers'] else 'moe'}"
                for i, r in enumerate(c["compress_ratios"][:n])]
    return ["moe" if i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0 else "dense" for i in range(n)]
