"""Rotary embedding for MLA's rope channels, plain or YaRN (DeepSeek-V2/V3 flavour).

Legend: T tokens, N heads, R rope dim (qk_rope_head_dim).
DeepSeek lays rope channels out as interleaved pairs (x0, x1), (x2, x3), ...; each pair is
rotated by one frequency. The rotated output keeps the same layout, so q and k cached by us
and q from a later step always agree.
"""
from __future__ import annotations

import math

import torch

from wideep.layers import NATIVE, Kernels

from .config import RopeConfig, yarn_mscale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [R/2] fp32, cos/sin scale). YaRN blends interpolated and extrapolated
    frequencies with a linear ramp over the channels between beta_fast and beta_slow rotations."""
    dim, base = cfg.dim, cfg.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if cfg.kind == "default":
        return extrapolation, 1.0
    interpolation = 1.0 / (cfg.factor * pos_freqs)
    low = math.floor(_yarn_correction_dim(cfg.beta_fast, dim, base, cfg.original_max_position))
    high = math.ceil(_yarn_correction_dim(cfg.beta_slow, dim, base, cfg.original_max_position))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    # cos/sin carry mscale(mscale)/mscale(mscale_all_dim); the softmax scale carries the rest.
    if cfg.attention_factor is not None:
        attn_factor = cfg.attention_factor
    elif cfg.mscale_all_dim:
        attn_factor = yarn_mscale(cfg.factor, cfg.mscale) / yarn_mscale(cfg.factor, cfg.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(cfg.factor, cfg.mscale)
    return inv_freq, float(attn_factor)


class RotaryEmbedding:
    """Holds a cos/sin table [P, R/2] that grows on demand; `apply` rotates [T, ..., R] by positions [T]."""

    def __init__(self, cfg: RopeConfig, device: torch.device | str = "cpu", kernels: Kernels = NATIVE):
        """kernels: the backend's table (layers/kernels.py); its rope, when it has one, does `apply`."""
        self.cfg = cfg
        self.kernel = kernels.rope
        self.inv_freq, self.scale = rope_inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(device)
        self._cos = torch.empty(0, cfg.dim // 2, device=device)
        self._sin = torch.empty(0, cfg.dim // 2, device=device)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        self._cos = freqs.cos() * self.scale
        self._sin = freqs.sin() * self.scale

    def cos_sin(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] fp32. `max_position` (host int) avoids a device sync."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0  # SYNC: table size check
        if max_position >= self._cos.shape[0]:
            self._grow(max_position + 1)
        return self._cos[positions], self._sin[positions]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool | None = None
              ) -> torch.Tensor:
        """x [T, ..., R]; cos/sin [T, R/2] -> rotated x, same layout and dtype. interleave: the channel
        layout, default the config's (DSA's indexer rotates half-split channels whatever MLA uses)."""
        interleave = self.cfg.interleave if interleave is None else interleave
        if self.kernel is not None:
            return self.kernel(x, cos, sin, interleave)
        return self.apply_native(x, cos, sin, interleave)

    def apply_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
        shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
        cos, sin = cos.view(shape), sin.view(shape)
        xf = x.float()
        if interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
