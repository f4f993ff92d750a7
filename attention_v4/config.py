"""Sub-config of DeepSeek-V4's attention (frozen, validated once by the model config).

Legend: H hidden, N heads, D head_dim (the one shared KV head is D wide, used as both K and V),
R rope dim (the trailing R channels of every head are rotated), Q q_lora_rank, G o_groups,
Lo o_lora_rank, W sliding_window, m compress ratio, NI / DI indexer heads / head dim.

Every layer attends over the raw KV of its last W tokens; a layer of kind
  "sliding"  sees nothing else,
  "csa"      (compressed sparse attention) also sees KV compressed m:1 (m = 4 in the released models) by
             overlapping gated windows, of which a lightning indexer picks the top `index_topk` per query,
  "hca"      (heavily compressed attention) also sees every entry of KV compressed m:1 (m = 128) by
             non-overlapping windows.
"""
from __future__ import annotations

from dataclasses import dataclass

from wideep.attention_mla.config import RopeConfig

KINDS = ("sliding", "csa", "hca")


@dataclass(frozen=True)
class V4AttentionConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_main: RopeConfig       # sliding layers' queries and keys
    rope_compress: RopeConfig   # CSA/HCA layers' queries, keys, compressed entries and indexer
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "sliding_window", "csa_ratio", "hca_ratio", "index_n_heads", "index_head_dim", "index_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DeepSeek-V4 attention needs {name} to be an int >= 1, got {v!r}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"the rope dim ({self.rope_dim}) must be even and at most head_dim ({self.head_dim})")
        if self.rope_dim > self.index_head_dim:
            raise ValueError(f"the indexer rotates the trailing {self.rope_dim} rope channels of each head, so "
                             f"index_head_dim ({self.index_head_dim}) must be at least that")
        if self.num_heads % self.o_groups:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be divisible by o_groups ({self.o_groups})")

    def ratio(self, kind: str) -> int:
        """The compress ratio m of a layer kind (0: no compressed stream)."""
        return {"sliding": 0, "csa": self.csa_ratio, "hca": self.hca_ratio}[kind]

    def rope(self, kind: str) -> RopeConfig:
        return self.rope_main if kind == "sliding" else self.rope_compress
