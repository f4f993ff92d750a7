"""The lightning indexer of a CSA layer: which compressed entries each query attends to.

Legend: T queries of one sequence, Q q_lora_rank, NI heads, DI head dim, S compressed entries so far, k index_topk.
The indexer keeps its own compressed keys (a Compressor at width DI, overlapping windows like CSA's), and
scores query t against entry s as  sum_h w_{t,h} * relu(q_{t,h} . key_s) * DI^-1/2,  w = weights_proj(x) * NI^-1/2.
Query t sees entry s only once s's window has closed: (s + 1) * m <= t + 1. Each query keeps its top
min(k, visible) entries.
"""
from __future__ import annotations

import torch
from torch import nn

from wideep.attention_mla.rope import RotaryEmbedding
from wideep.layers import NATIVE, Kernels

from .compressor import Compressor, apply_rope_tail


class Indexer(nn.Module):
    """wq_b [NI*DI, Q], weights_proj [NI, H], compressor (DeepSeek's names)."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, ratio: int, eps: float,
                 device=None, dtype=None, linear=nn.Linear, kernels: Kernels = NATIVE):
        super().__init__()
        self.heads, self.head_dim, self.topk, self.ratio = heads, head_dim, topk, ratio
        self.wq_b = linear(q_lora_rank, heads * head_dim, bias=False, device=device, dtype=dtype)
        self.weights_proj = linear(hidden, heads, bias=False, device=device, dtype=dtype)
        self.compressor = Compressor(hidden, head_dim, ratio, True, eps, device=device, dtype=dtype, linear=linear,
                                     kernels=kernels)

    def select(self, x: torch.Tensor, q_lat: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], q_lat [T, Q], keys [S, DI] (every entry so far, this chunk's included), positions [T],
        cos/sin [T, R/2] (compress table) -> (top [T, k'] entry ids, valid [T, k'] bool): the entries each query
        attends to, k' = min(k, S); a query with fewer than k' visible entries has the rest not valid."""
        T, S = x.shape[0], keys.shape[0]
        visible = (torch.arange(S, device=x.device)[None, :] + 1) * self.ratio <= positions[:, None] + 1  # [T, S]
        if S == 0:
            return torch.zeros(T, 0, dtype=torch.int64, device=x.device), visible
        q = apply_rope_tail(self.wq_b(q_lat).view(T, self.heads, self.head_dim), cos, sin, rope).float()
        w = self.weights_proj(x).float() * (self.heads ** -0.5 * self.head_dim ** -0.5)   # [T, NI]
        kt = keys.float().t()
        scores = torch.zeros(T, S, device=x.device)
        for h in range(self.heads):   # one head at a time: never a [T, NI, S] tensor
            scores.addcmul_(torch.mm(q[:, h], kt).relu_(), w[:, h, None])
        scores.masked_fill_(~visible, float("-inf"))                           # [T, S]
        k = min(self.topk, S)
        top = scores.topk(k, dim=-1).indices                                   # [T, k]
        return top, visible.gather(1, top)
