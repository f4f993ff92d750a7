"""Sub-configs for MLA attention and its rotary embedding (frozen, validated by the model config)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over the `dim` rope channels of each head.

    kind "default" is plain RoPE; "yarn" is YaRN as DeepSeek uses it (NTK-by-parts frequency
    blend between `beta_fast` and `beta_slow`, cos/sin scaled by mscale(mscale)/mscale(mscale_all_dim)).
    """

    dim: int
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleave: bool = True  # DeepSeek's rope channels are (x0, x1), (x2, x3), ... pairs
    attention_factor: float | None = None  # YaRN's cos/sin scale when the config fixes it (DeepSeek-V4: 1.0)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention shapes. Legend: H hidden, N heads, C kv_lora_rank, R rope dim."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Per-token width of the latent cache: compressed kv (C) + shared rope key (R)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        # YaRN sharpens the softmax by mscale(mscale_all_dim)^2 (DeepSeek-V2/V3 reference).
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (V3.2): a lightning indexer picks each query's top-`index_topk`
    context tokens and MLA attends over those only. Legend: NI indexer heads, Dk indexer head dim,
    R rope dim (the first R channels of the indexer's q and k are rotated, half-split), Q q_lora_rank.
    The indexer caches one key [Dk] per token per layer, beside the latent [C+R]."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_dim: int
    q_lora_rank: int

    def __post_init__(self) -> None:
        for name in ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DSA needs {name} to be an int >= 1, got {v!r}")
        if self.index_head_dim < self.rope_dim:
            raise ValueError(f"DSA rotates the first qk_rope_head_dim ({self.rope_dim}) channels of each indexer "
                             f"head, so index_head_dim ({self.index_head_dim}) must be at least that")
