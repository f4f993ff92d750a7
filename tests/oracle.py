"""transformers as the external oracle: tiny random DeepseekV2/V3 models, saved with save_pretrained."""
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


def make_hf_model(arch: str, out_dir: str, seed: int = 0, bias_std: float = 0.0, **overrides):
    """Build, randomise and save a tiny HF model; returns it (float32, eval)."""
    import transformers
    torch.manual_seed(seed)
    base = dict(V3_BASE if arch == "v3" else V2_BASE)
    base.update(overrides)
    if arch == "v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**base))
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**base))
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
