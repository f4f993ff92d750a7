"""The KV compressor of CSA/HCA layers (and, at the indexer's width, of the CSA indexer's keys).

Legend: T new tokens of one sequence, H hidden, D output width, m ratio, C = D (HCA) or 2D (CSA, overlapping),
n closed windows. Every m tokens close a window and emit one entry:

    entry_w = RMSNorm( sum_j softmax_j(gate_j + ape_j) * kv_j ),  rope (compress table) at position w*m

HCA: j runs over window w's m tokens. CSA (overlap): each token projects two series, Ca = [:D] and
Cb = [D:]; j runs over window w-1's Ca (m slots) and window w's Cb (m slots), width 2m, stride m;
window 0 has no predecessor (its Ca slots weigh 0).

What a sequence carries between chunks (CompressorState, one per compressor per sequence): the rows of
its open window (fewer than m, gate without ape) and, for CSA, the last closed window's Ca rows (gate
with ape) and the number of entries emitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from attention_mla.rope import RotaryEmbedding
from layers import RMSNorm


@dataclass
class CompressorState:
    """One sequence's open window. buf_kv / buf_gate [b < m, C]; prev_kv / prev_gate [m, D] (CSA) or None."""
    buf_kv: torch.Tensor
    buf_gate: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    entries: int = 0
    capture: dict[int, int] = field(default_factory=dict)   # CSA: entry index -> where its window's overlap rows go
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)   # filled by forward

    @classmethod
    def empty(cls, width: int, device, dtype) -> "CompressorState":
        z = torch.zeros(0, width, device=device, dtype=dtype)
        return cls(z, z.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.buf_kv, self.buf_gate, self.prev_kv, self.prev_gate)
                   if t is not None)


class Compressor(nn.Module):
    """wkv, wgate [C, H], ape [m, C] (fp32), norm [D]; names as DeepSeek's checkpoints spell them."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, device=None, dtype=None):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden, width, bias=False, device=device, dtype=dtype)
        self.wgate = nn.Linear(hidden, width, bias=False, device=device, dtype=dtype)
        self.ape = nn.Parameter(torch.empty(ratio, width, device=device, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps, device=device, dtype=dtype)

    @property
    def width(self) -> int:
        return self.wkv.out_features

    def forward(self, x: torch.Tensor, state: CompressorState, rope: RotaryEmbedding) -> torch.Tensor:
        """x [T, H] (one sequence's new tokens, in order) -> the entries their windows close [n, D], rotated;
        `state` is advanced in place."""
        m, D = self.ratio, self.dim
        kv = torch.cat([state.buf_kv, self.wkv(x)])
        gate = torch.cat([state.buf_gate, self.wgate(x)])
        n = kv.shape[0] // m
        state.buf_kv, state.buf_gate = kv[n * m:], gate[n * m:]
        if n == 0:
            return kv.new_zeros(0, D)
        kv = kv[:n * m].view(n, m, -1)
        gate = gate[:n * m].view(n, m, -1) + self.ape.to(gate.dtype)           # [n, m, C]
        if self.overlap:
            prev_kv = kv.new_zeros(n, m, D)
            prev_gate = gate.new_full((n, m, D), float("-inf"))
            prev_kv[1:], prev_gate[1:] = kv[:-1, :, :D], gate[:-1, :, :D]
            if state.prev_kv is not None:
                prev_kv[0], prev_gate[0] = state.prev_kv, state.prev_gate
            state.prev_kv, state.prev_gate = kv[-1, :, :D].clone(), gate[-1, :, :D].clone()
            for e in state.capture:   # prefix-cache boundaries: the prev rows a sequence resuming there needs
                if state.entries <= e < state.entries + n:
                    w = e - state.entries
                    state.captured[e] = (kv[w, :, :D].clone(), gate[w, :, :D].clone())
            kv = torch.cat([prev_kv, kv[..., D:]], dim=1)                      # [n, 2m, D]
            gate = torch.cat([prev_gate, gate[..., D:]], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.norm((kv * weights).sum(dim=1))                         # [n, D]
        positions = (torch.arange(n, device=x.device) + state.entries) * m
        state.entries += n
        cos, sin = rope.cos_sin(positions, max_position=(state.entries - 1) * m)
        return apply_rope_tail(entries, cos, sin, rope)


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """x [T, (N,) D] -> x with its trailing R channels rotated (interleaved pairs) by cos, sin [T, R/2]."""
    r = 2 * cos.shape[-1]
    return torch.cat([x[..., :-r], rope.apply_native(x[..., -r:], cos, sin, True)], dim=-1)
