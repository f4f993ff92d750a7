"""DeepSeek-V4's multi-token-prediction (MTP) blocks, loaded with the model and not run by its forward: the
speculative-decoding work drives them. Checkpoint names `mtp.{k}.*` (DeepSeek's; transformers 5.24 has no MTP
module and drops them on load).

Legend: T tokens, n hc_mult, H hidden. Block k is a full V4 decoder layer (attention, hyper-connections, MoE with
one shared expert; never hash-routed; its attention kind from compress_ratios past the L layers, sliding-window by
default) plus what turns the main model's streams and the next token into its input and its output into logits:
    x [T, n, H] = e_proj(enorm(embed(next_ids)))[:, None] + h_proj(hnorm(streams))     (streams: the main model's)
    x = layer(x);   logits = head(norm(hc_head(x)))
embed and head are the main model's (shared, not stored in the block).
"""
from __future__ import annotations

from torch import nn

from layers import RMSNorm
from layers.hyper_connection import HyperHead

from .v4_model import V4DecoderLayer


class V4MTPBlock(V4DecoderLayer):
    """A V4 decoder layer with the MTP input projections e_proj / h_proj [H, H], their norms enorm / hnorm [H], and
    its own output head: hc_head (HyperHead) and norm [H]. `index` is L + k (the layer after the main stack)."""

    def __init__(self, cfg, k: int, rope, shard, experts, routing, device=None, dtype=None):
        v4, H = cfg.v4, cfg.hidden_size
        super().__init__(cfg, cfg.num_hidden_layers + k, rope, shard, experts, routing, device=device, dtype=dtype,
                         kind=v4.mtp_layer_kinds[k], hash_moe=False)
        self.e_proj = nn.Linear(H, H, bias=False, device=device, dtype=dtype)
        self.h_proj = nn.Linear(H, H, bias=False, device=device, dtype=dtype)
        self.enorm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.hc_head = HyperHead(H, v4.hc_mult, v4.hc_eps, cfg.rms_norm_eps, device=device)
