"""Tile sizes for the Triton fused-MoE GEMMs: a small table keyed by tokens per expert.

Few tokens per expert (decode) make the GEMM a stream over the expert weights: short row blocks
(BM 16) so padding wastes little, wide K tiles. Many (prefill) make it compute-bound: 128-row blocks,
deeper pipelines. fp8 weights need BK to divide the quantisation block (one scale per K tile).
Every row compiles for sm_90 without register spills and pipelines its loads (checked ahead of time,
without a GPU, by tests/kernels/test_sm90_compile.py); the choice between rows is untuned.
Under the Triton interpreter (CPU) the tiles are the smallest tl.dot takes: every program is
Python there, and small tiles keep the masks and the multi-block paths exercised on tiny shapes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoETiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoETiles.{name} must be a power of two >= 16 (tl.dot), got {v}")


# (max tokens per expert, tiles): first row whose bound is >= the average wins
_TABLE: list[tuple[float, MoETiles]] = [
    (16, MoETiles(16, 64, 128, group_m=1, num_warps=4, num_stages=4)),
    (64, MoETiles(32, 64, 128, group_m=4, num_warps=4, num_stages=4)),
    (256, MoETiles(64, 128, 64, group_m=8, num_warps=4, num_stages=4)),
    (float("inf"), MoETiles(128, 256, 64, group_m=8, num_warps=8, num_stages=3)),
]
INTERPRET_TILES = MoETiles(16, 32, 32, group_m=2, num_warps=1, num_stages=1)


def pick_tiles(num_pairs: int, num_experts: int, interpret: bool = False, quant_k: int | None = None,
               fp32: bool = False) -> MoETiles:
    """Tiles for `num_pairs` (row, slot) pairs over `num_experts` local experts.
    quant_k: the fp8 weight block along K (BK is capped to divide it); fp32: halve BK (4-byte tiles)."""
    if interpret:
        t = INTERPRET_TILES
    else:
        per_expert = num_pairs / max(num_experts, 1)
        t = next(tiles for bound, tiles in _TABLE if per_expert <= bound)
        if fp32:
            t = MoETiles(t.block_m, t.block_n, max(16, t.block_k // 2), t.group_m, t.num_warps, t.num_stages)
    if quant_k is not None:
        bk = t.block_k
        while bk > 16 and quant_k % bk:
            bk //= 2
        if quant_k % bk:
            raise ValueError(f"fp8 weight block along K ({quant_k}) is not a multiple of 16; "
                             f"the Triton path needs one scale per K tile")
        t = MoETiles(t.block_m, t.block_n, bk, t.group_m, t.num_warps, t.num_stages)
    return t
