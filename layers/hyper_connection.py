"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is n parallel streams.

Legend: T tokens, n hc_mult streams, H hidden. Before a block (attention or MoE), the streams [T, n, H] give
three weights through one projection of their RMS-normalised concatenation:
    pre  [T, n]     = sigmoid(. * scale0 + base) + eps            collapses the streams into the block's input
    post [T, n]     = 2 * sigmoid(. * scale1 + base)              spreads the block's output over the streams
    comb [T, n, n]  = Sinkhorn(softmax(. * scale2 + base) + eps)  (rows and columns sum to ~1) mixes the streams
and after it  streams'_k = post_k * out + sum_j comb_jk * streams_j.
HyperHead collapses the streams once more (pre only) before the final norm. Everything runs in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import NATIVE, Kernels


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """fn [(2+n)*n, n*H], base [(2+n)*n], scale [3], fp32 (DeepSeek's hc_attn_* / hc_ffn_*)."""

    def __init__(self, hidden: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float, device=None,
                 kernels: Kernels = NATIVE):
        """kernels: the backend's table; its hc_enter / hc_leave, when it has them, are enter / leave."""
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        self.enter_kernel, self.leave_kernel = kernels.hc_enter, kernels.hc_leave
        f32 = dict(device=device, dtype=torch.float32)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden, **f32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, **f32))
        self.scale = nn.Parameter(torch.empty(3, **f32))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> pre [T, n], post [T, n], comb [T, n, n] (fp32)."""
        n = self.n
        mixes = F.linear(_unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre, post, comb = (mixes * self.scale.repeat_interleave(torch.tensor([n, n, n * n], device=mixes.device))
                           + self.base).split([n, n, n * n], dim=-1)
        pre = pre.sigmoid() + self.eps
        post = 2 * post.sigmoid()
        comb = comb.view(-1, n, n).softmax(-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return pre, post, comb

    def enter(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (the block's input [T, H], post, comb): weights, then collapse."""
        if self.enter_kernel is not None:
            y, _, post, comb = self.enter_kernel(streams, self.fn, self.base, self.scale, self.iters, self.eps,
                                                 self.norm_eps)
            return y, post, comb
        pre, post, comb = self.weights(streams)
        return self.collapse(streams, pre), post, comb

    def leave(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """= expand (the kernel's when bound)."""
        if self.leave_kernel is not None:
            return self.leave_kernel(streams, out, post, comb)
        return self.expand(streams, out, post, comb)

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """streams [T, n, H], pre [T, n] -> [T, H]."""
        return (pre[..., None] * streams).sum(1).to(streams.dtype)

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """streams [T, n, H], the block's out [T, H] -> the next streams [T, n, H]."""
        dt = streams.dtype
        return post.to(dt)[..., None] * out[:, None, :] + comb.to(dt).transpose(1, 2) @ streams


class HyperHead(nn.Module):
    """fn [n, n*H], base [n], scale [1], fp32 (DeepSeek's hc_head_*)."""

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float, device=None, kernels: Kernels = NATIVE):
        super().__init__()
        self.eps, self.norm_eps, self.kernel = eps, norm_eps, kernels.hc_enter
        f32 = dict(device=device, dtype=torch.float32)
        self.fn = nn.Parameter(torch.empty(n, n * hidden, **f32))
        self.base = nn.Parameter(torch.empty(n, **f32))
        self.scale = nn.Parameter(torch.empty(1, **f32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, n, H] -> [T, H]."""
        if self.kernel is not None:
            return self.kernel(streams, self.fn, self.base, self.scale, 0, self.eps, self.norm_eps, head=True)[0]
        mixes = F.linear(_unweighted_rms(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre = (mixes * self.scale + self.base).sigmoid() + self.eps
        return HyperConnection.collapse(streams, pre)
