"""The per-op kernels a backend gives the modules when the model is built (vLLM's CustomOp, as a table).

Every module keeps its reference forward (torch ops); a backend that has a faster kernel for an op
fills its entry, and the module binds it in its constructor. A forward never asks which device or
backend it is on: the choice was made once, here. `NATIVE` (every entry None) is the torch forward.

    RMSNorm:          rmsnorm(x [..., N], weight [N], eps) -> [..., N]
    RotaryEmbedding:  rope(x [T, (N,) R], cos, sin [T, R/2], interleave) -> [T, (N,) R]
    projections:      linear, an nn.Linear subclass (same parameters, so checkpoints load unchanged)
    lm_head:          matmul(x [n, H], weight [V, H]) -> [n, V] (= F.linear)
    fp8 projections:  fp8_linear(x [..., K], weight [N, K] e4m3, scale_inv [ceil(N/br), ceil(K/bk)], block)
                      -> [..., N] in x's dtype (= F.linear on moe/fp8.py's dequantize_fp8_block), for
                      moe/fp8_linear.py Fp8Linear; the experts kernel then takes fp8 weights too
                      (experts(..., w13_scale=, w2_scale=, block=))
    Gate:             route(x [T, H], weight [E, H], bias [E] | None, MoEConfig) -> ids, weights [T, k]
    Experts:          experts(x [R, H], w13, w2, ids [R, k] local, weights [R, k], limit=None) -> [R, H]
                      (limit: the clamped SwiGLU; fp4 weights: uint8 pairs with w13_scale=, w2_scale= e8m0 bytes)
                      and experts_max_rows(weight dtype, x dtype) -> the mean rows per local expert up to
                      which that kernel beats BLAS (None: every batch; the module's grouped GEMMs past it)
    HyperConnection:  hc_enter(streams [T, n, H], fn, base, scale, iters, eps, norm_eps, head=False)
                      -> (collapsed [T, H], pre [T, n], post, comb [T, n, n]; head: post, comb None) and
                      hc_leave(streams, out [T, H], post, comb) -> streams [T, n, H] (= weights + collapse, expand)
    MLA paged decode: mla_decode(q [B, N, C+R], pool, table, lens, block_size, C, scale, max_len, fp8) -> [B, N, C]
                      and bmm_nt(x [N, B, K], w [N, M, K], out=[N, B, M]) for the absorbed projections
The CPU backend's table is cpu/kernels.py (engine/model/build.py fills this from it).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class Kernels:
    name: str = "torch"
    rmsnorm: Callable | None = None
    rope: Callable | None = None
    linear: type = nn.Linear
    matmul: Callable | None = None
    fp8_linear: Callable | None = None
    route: Callable | None = None
    experts: Callable | None = None
    experts_max_rows: Callable | None = None
    hc_enter: Callable | None = None
    hc_leave: Callable | None = None
    mla_decode: Callable | None = None
    bmm_nt: Callable | None = None

    @classmethod
    def from_table(cls, name: str, table: dict) -> "Kernels":
        """A backend's table (name -> kernel); a name this class has no entry for is an error."""
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"kernel table {name!r} has entries no module takes: {unknown} (known: {sorted(known)})")
        return cls(name=name, **table)


NATIVE = Kernels()
