"""transformers 5.24's DeepseekV4ForCausalLM as the oracle: tiny random models saved with save_pretrained, with
what transformers initialises to degenerate values randomised first (its tid2eid is all zeros; gate biases,
attention sinks, compressor position biases and the hyper-connections' bases are zeros, their scales ones)."""
from __future__ import annotations

import torch

FLASH = ["sliding_attention", "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
PRO = ["heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
       "heavily_compressed_attention", "compressed_sparse_attention"]
# 8 indexer heads: a compressed entry's index score is almost never exactly 0 (relu of every head), so the
# top-k has no ties for differently shaped calls to break differently
V4_BASE = dict(vocab_size=200, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
               head_dim=32, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, sliding_window=8, o_groups=2,
               o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4, qk_rope_head_dim=8,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
               layer_types=FLASH, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
               max_position_embeddings=1024, initializer_range=0.1, swiglu_limit=1.0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


def make_v4_model(out_dir: str, seed: int = 0, **overrides):
    """Build, randomise and save a tiny DeepSeek-V4; returns it (float32, eval)."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV4Config(**dict(V4_BASE, **overrides))
    model = transformers.DeepseekV4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith((".sinks", ".position_bias", ".base", ".hc_base")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith((".scale", ".hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("tid2eid"):   # k distinct experts per token id
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
    model.eval().float()
    model.save_pretrained(out_dir)
    return model
