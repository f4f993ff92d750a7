"""DeepSeek-V3.2's lightning indexer and the top-k selection it drives (DeepSeek Sparse Attention).

Legend: T query tokens, NI indexer heads, Dk indexer head dim, R rope dim, Q q_lora_rank, H hidden,
L context length, k index_topk.
Each token caches one indexer key [Dk] per layer (wk, then a LayerNorm, then its first R channels
rotated half-split), in a pool paged exactly like the latent cache (the same slots). Query t scores
context token j as
    I[t, j] = sum_h w[t, h] * relu(q[t, h] . key[j] / sqrt(Dk)),   w = weights_proj(x) / sqrt(NI)
with q = wq_b(q-LoRA latent) per head (rotated like the key). That is how transformers computes it,
in fp32; DeepSeek's kernels add a Hadamard rotation (it keeps dot products) and fp8 (a precision
choice). Query t then attends to the k best of the tokens it may see (positions j < key_limit[t]),
the earlier of two equal scores first, so a decode step picks what a prefill of its context picks:
all of them when there are at most k, so a context within index_topk is plain causal attention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSAConfig
from .rope import RotaryEmbedding

SCORE_BUDGET = 1 << 25   # fp32 elements of [rows, NI, L] head scores held at once (128 MiB)


class Indexer(nn.Module):
    """Checkpoint names as in DeepSeek-V3.2: `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`.
    weights_proj stays fp32 whatever the model dtype (transformers keeps it so)."""

    def __init__(self, cfg: DSAConfig, hidden_size: int, rope: RotaryEmbedding, device=None, dtype=None):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        NI, Dk = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, NI * Dk, bias=False, device=device, dtype=dtype)
        self.wk = nn.Linear(hidden_size, Dk, bias=False, device=device, dtype=dtype)
        self.k_norm = nn.LayerNorm(Dk, eps=1e-6, device=device, dtype=dtype)
        self.weights_proj = nn.Linear(hidden_size, NI, bias=False, device=device, dtype=torch.float32)
        self.scale = Dk ** -0.5

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        R = self.cfg.rope_dim
        rot = self.rope.apply(t[..., :R], cos, sin, interleave=False)
        return torch.cat((rot, t[..., R:]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H], cos/sin [T, R/2] -> the keys to cache [T, Dk]."""
        return self._rotate(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], q_lat [T, Q] -> q [T, NI, Dk], head weights w [T, NI] fp32 (1/sqrt(NI) included)."""
        q = self.wq_b(q_lat).view(x.shape[0], self.cfg.index_n_heads, self.cfg.index_head_dim)
        w = self.weights_proj(x.float()) * self.cfg.index_n_heads ** -0.5
        return self._rotate(q, cos, sin), w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [T, NI, Dk], w [T, NI], keys [T, L, Dk] (each token's context) or [1, L, Dk] (one shared
        context) -> I [T, L] fp32. Computed SCORE_BUDGET elements of head scores at a time."""
        T, NI, L = q.shape[0], q.shape[1], keys.shape[1]
        out = torch.empty(T, L, dtype=torch.float32, device=q.device)
        step = max(1, SCORE_BUDGET // max(1, NI * L))
        for a in range(0, T, step):
            k = keys if keys.shape[0] == 1 else keys[a:a + step]
            s = F.relu(torch.matmul(q[a:a + step].float(), k.float().transpose(1, 2)) * self.scale)  # [t, NI, L]
            out[a:a + step] = torch.matmul(w[a:a + step, None, :], s)[:, 0]
        return out


def tie_broken_keys(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, L] fp32 -> keys [T, L] int64, ordered as the scores, and where two scores are equal the
    earlier position above the later: every key of a row is distinct.
    Why: exact ties are common, not rare (a token that no head scores above 0 scores exactly 0, and with a
    negative head weight 0 is the best score there is), and torch.topk breaks them by its algorithm, which
    depends on the row's length. A decode step (a row as long as its context) and a prefill of the same
    context (a row as long as the prompt, the rest masked) then attend to different tokens of one tie."""
    L = scores.shape[1]
    bits = (scores.float() + 0.0).view(torch.int32)   # + 0.0: -0.0 (a negative weight times relu's 0) is +0.0
    # IEEE floats order as their bits do among positives; a negative's other 31 bits run backwards
    bits ^= (bits >> 31) & 0x7FFFFFFF
    earlier = (L - 1) - torch.arange(L, device=scores.device)                   # [L], in [0, 2**32)
    return bits.to(torch.int64).mul_(1 << 32).add_(earlier)


def select_topk(scores: torch.Tensor, key_limit: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, L] fp32, key_limit [T] (token t sees positions j < key_limit[t] <= L) ->
    (idx [T, min(k, L)] positions, best first: the first n[t] are the selection, the rest padding;
     n [T] = min(key_limit, k)). Equal scores: the earlier position is taken (tie_broken_keys), so
    the selection depends on the scores only, not on how long the row is."""
    L = scores.shape[1]
    kk = min(k, L)
    hidden = torch.arange(L, device=scores.device)[None, :] >= key_limit[:, None]
    keys = tie_broken_keys(scores.masked_fill(hidden, float("-inf")))
    idx = keys.topk(kk, dim=-1).indices
    return idx, key_limit.clamp(max=kk)


def selection_mask(idx: torch.Tensor, n: torch.Tensor, L: int) -> torch.Tensor:
    """idx [T, kk], n [T] (select_topk's) -> mask [T, L] bool, True at the n[t] selected positions."""
    valid = torch.arange(idx.shape[1], device=idx.device)[None, :] < n[:, None]
    return torch.zeros(idx.shape[0], L, dtype=torch.bool, device=idx.device).scatter_(1, idx, valid)
