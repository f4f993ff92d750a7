"""transformers as the external oracle: tiny random DeepSeek-V2/V3/V3.2 and GLM-4.x-MoE-lite models, saved with
save_pretrained; our own tiny checkpoints (launch/tiny/checkpoint.py) loaded into transformers' classes."""
from __future__ import annotations

import torch

V3_BASE = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
               n_routed_experts=16, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
               qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=2,
               norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=256,
               initializer_range=0.15, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

V2_BASE = dict(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
               n_routed_experts=16, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
               qk_nope_head_dim=16, n_group=4, topk_group=2, topk_method="group_limited_greedy",
               num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
               max_position_embeddings=256, initializer_range=0.15,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


# DSA: 16 indexer heads, so that a token's index score is almost never exactly 0 (relu of every head):
# ties at the k-th place would be broken arbitrarily, differently by differently shaped top-k calls
V32_BASE = dict(V3_BASE, index_topk=8, index_n_heads=16, index_head_dim=16)
GLM_BASE = dict({k: v for k, v in V3_BASE.items() if k != "first_k_dense_replace"}, n_group=1, topk_group=1,
                v_head_dim=24, rms_norm_eps=1e-5, routed_scaling_factor=1.8, mlp_layer_types=["dense"] + ["sparse"] * 3)
BASES = {"v2": ("DeepseekV2", V2_BASE), "v3": ("DeepseekV3", V3_BASE), "v32": ("DeepseekV32", V32_BASE),
         "glm4_moe_lite": ("Glm4MoeLite", GLM_BASE)}
TINY_CLASSES = {"v2": "DeepseekV2ForCausalLM", "v3": "DeepseekV3ForCausalLM", "v32": "DeepseekV32ForCausalLM",
                "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "kimi_k25": "Kimi_K25ForConditionalGeneration"}


def make_hf_model(arch: str, out_dir: str, seed: int = 0, bias_std: float = 0.0, **overrides):
    """Build, randomise and save a tiny HF model; returns it (float32, eval)."""
    import transformers
    torch.manual_seed(seed)
    name, base = BASES[arch]
    base = dict(base)
    base.update(overrides)
    model = getattr(transformers, name + "ForCausalLM")(getattr(transformers, name + "Config")(**base))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        if bias_std:
            for m in model.modules():
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.copy_(bias_std * torch.randn_like(m.e_score_correction_bias))
    model.eval().float()
    model.save_pretrained(out_dir)
    return model


def load_tiny_in_hf(arch: str, model_dir: str):
    """Our tiny checkpoint (launch/tiny/checkpoint.py) in transformers' class for `arch`, every tensor matched; float32,
    eval."""
    import transformers
    model, info = getattr(transformers, TINY_CLASSES[arch]).from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval().float()


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """-> [len(ids)-1] logprob of token j given tokens < j, j = 1..n-1."""
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = logits.log_softmax(-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation recomputed from scratch every step (no HF cache involved)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
