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

Speculative decoding (a chunk whose later tokens are drafts that may be rejected): a state with `keep` set gets
`rewind`, a Rewind that rebuilds the state at any position of the chunk from the rows it took, so that the
rejected drafts' rows leave no trace. The entries their windows closed need no undoing: entry e sits at index e,
is read only by queries past it, and is written again when its window really closes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from wideep.attention_mla.rope import RotaryEmbedding
from wideep.layers import NATIVE, Kernels, RMSNorm


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
    keep: bool = False              # speculative chunk: forward leaves a Rewind in `rewind`
    rewind: "Rewind | None" = None

    @classmethod
    def empty(cls, width: int, device, dtype) -> "CompressorState":
        z = torch.zeros(0, width, device=device, dtype=dtype)
        return cls(z, z.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.buf_kv, self.buf_gate, self.prev_kv, self.prev_gate)
                   if t is not None)


class Compressor(nn.Module):
    """wkv, wgate [C, H], ape [m, C] (fp32), norm [D]; names as DeepSeek's checkpoints spell them."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, device=None, dtype=None,
                 linear=nn.Linear, kernels: Kernels = NATIVE):
        """linear: the projections' class; kernels: the backend's table for the norm (layers/kernels.py)."""
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = linear(hidden, width, bias=False, device=device, dtype=dtype)
        self.wgate = linear(hidden, width, bias=False, device=device, dtype=dtype)
        self.ape = nn.Parameter(torch.empty(ratio, width, device=device, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps, device=device, dtype=dtype, kernels=kernels)

    @property
    def width(self) -> int:
        return self.wkv.out_features

    def forward(self, x: torch.Tensor, state: CompressorState, rope: RotaryEmbedding) -> torch.Tensor:
        """x [T, H] (one sequence's new tokens, in order) -> the entries their windows close [n, D], rotated;
        `state` is advanced in place."""
        m, D = self.ratio, self.dim
        kv = torch.cat([state.buf_kv, self.wkv(x)])
        gate = torch.cat([state.buf_gate, self.wgate(x)])
        if state.keep:   # (the open window's rows and this chunk's; prev as it was, copied: the pool's is rewritten)
            prev = None if state.prev_kv is None else (state.prev_kv.clone(), state.prev_gate.clone())
            state.rewind = Rewind(state.entries * m, m, D, kv, gate, prev,
                                  self.ape[:, :D] if self.overlap else None)
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


@dataclass
class Rewind:
    """A compressor state's rows from its open window's first position `start` (a multiple of m) to the end of the
    chunk it took: kv / gate [end - start, C] (gate without ape), and its prev rows before the chunk (CSA; None
    when no window had closed). ape_prev: CSA's ape over the overlap half [m, D] (None: HCA)."""
    start: int
    ratio: int
    dim: int
    kv: torch.Tensor
    gate: torch.Tensor
    prev: tuple[torch.Tensor, torch.Tensor] | None
    ape_prev: torch.Tensor | None

    @property
    def end(self) -> int:
        return self.start + self.kv.shape[0]

    def state_at(self, p: int) -> CompressorState:
        """The state after the tokens before position p (start <= p <= end): its open window's rows and, for CSA,
        the overlap rows of the window before it."""
        if not self.start <= p <= self.end:
            raise ValueError(f"a compressor state at position {p}, the chunk's rows cover {self.start} .. {self.end}")
        m, D, w = self.ratio, self.dim, p // self.ratio
        lo = w * m - self.start
        st = CompressorState(self.kv[lo:p - self.start], self.gate[lo:p - self.start], entries=w)
        if self.ape_prev is not None:
            if w == self.start // m:   # no window closed before p in this chunk
                if self.prev is not None:
                    st.prev_kv, st.prev_gate = self.prev
            else:
                st.prev_kv = self.kv[lo - m:lo, :D]
                st.prev_gate = self.gate[lo - m:lo, :D] + self.ape_prev.to(self.gate.dtype)
        return st


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """x [T, (N,) D] -> x with its trailing R channels rotated (interleaved pairs) by cos, sin [T, R/2]."""
    r = 2 * cos.shape[-1]
    return torch.cat([x[..., :-r], rope.apply_native(x[..., -r:], cos, sin, True)], dim=-1)
