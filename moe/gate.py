"""Router: logical top-k expert ids and weights per token.

Legend: T tokens, H hidden, E logical experts, k top-k, G groups (n_group).
- greedy: top-k of the scores.
- group_limited_greedy (DeepSeek-V2): keep the topk_group groups with the highest max score.
- noaux_tc (DeepSeek-V3): groups ranked by the sum of their top-2 (score + e_score_correction_bias);
  the bias steers *selection* only; weights come from the unbiased scores.
- hash (DeepSeek-V4's first layers): the k experts of a token are a frozen table's, tid2eid[token id] [V, k];
  the scores still weight them.
Scores: softmax, sigmoid, or sqrtsoftplus (sqrt(softplus(logit)), DeepSeek-V4).
Weights are renormalised over the k chosen when norm_topk_prob, then times routed_scaling_factor.
Routing runs in fp32 whatever the model dtype. A backend's route kernel (layers/kernels.py), when it
has one, is the forward (the CPU backend's: the whole router in one call instead of ~15 ops).
"""
from __future__ import annotations

import torch
from torch import nn

from wideep.layers import NATIVE, Kernels

from .config import MoEConfig


class Gate(nn.Module):
    def __init__(self, cfg: MoEConfig, device=None, kernels: Kernels = NATIVE, hash_vocab: int | None = None):
        """hash_vocab: route by token id through a tid2eid table [hash_vocab, k] (filled by the checkpoint)."""
        super().__init__()
        self.cfg, self.kernel = cfg, kernels.route
        E, H = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(E, H, device=device, dtype=torch.float32))
        self.register_buffer("tid2eid", None)
        if hash_vocab is not None:
            if self.kernel is not None:
                raise ValueError("a hash-routed gate takes no route kernel (the kernel table's routes by scores)")
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, cfg.top_k, device=device, dtype=torch.int64))
            self.e_score_correction_bias = None
        elif cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (, input_ids [T] for a hash-routed gate) -> topk_ids [T, k] int64 (logical), topk_weights [T, k]
        fp32."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.e_score_correction_bias, self.cfg)
        return self.forward_native(x, input_ids)

    def forward_native(self, x: torch.Tensor, input_ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = x.float() @ self.weight.t()                                   # [T, E]
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(-1)
        elif cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = torch.nn.functional.softplus(logits).sqrt()
        choice = scores
        if self.tid2eid is not None:
            if input_ids is None:
                raise ValueError("a hash-routed gate needs the tokens' ids")
            topk_ids = self.tid2eid[input_ids]                                 # [T, k]
            return self._weights(scores, topk_ids)
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            T = x.shape[0]
            if self.e_score_correction_bias is not None:
                choice = scores + self.e_score_correction_bias
            grouped = choice.view(T, cfg.n_group, cfg.n_routed_experts // cfg.n_group)  # [T, G, E/G]
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)         # [T, G]
            else:
                group_scores = grouped.amax(-1)
            keep = group_scores.topk(cfg.topk_group, dim=-1).indices          # [T, topk_group]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(T, cfg.n_routed_experts)
        elif self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias
        topk_ids = choice.topk(cfg.top_k, dim=-1).indices                      # [T, k]
        return self._weights(scores, topk_ids)

    def _weights(self, scores: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        topk_weights = scores.gather(1, topk_ids)
        if cfg.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights * cfg.routed_scaling_factor
