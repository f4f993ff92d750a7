"""Triton fused MoE == the reference experts (for-loop), stage by stage and end to end.
Fresh random inputs every run; every output buffer is NaN-poisoned before its launch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wideep.moe.align import align_by_expert  # noqa: E402
from wideep.moe.experts import Experts  # noqa: E402
from wideep.moe.tiles import MoETiles  # noqa: E402
from wideep.moe.triton_moe import fused_moe, moe_down, moe_gate_up, moe_sum  # noqa: E402
from tests.kernels.conftest import poisoned  # noqa: E402

TILES = MoETiles(16, 16, 16, group_m=2, num_warps=1, num_stages=1)


def _experts(E, H, I, dtype, device) -> Experts:
    ex = Experts(E, H, I, device=device, dtype=dtype)
    with torch.no_grad():
        ex.w13.normal_(0, H ** -0.5)
        ex.w2.normal_(0, I ** -0.5)
    return ex


def _routing(R, E, k, device, counts=None):
    """Random top-k ids (some -1) and weights; `counts` forces per-expert pair counts (top-1)."""
    if counts is not None:
        ids = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])[torch.randperm(sum(counts))][:, None]
    else:
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(R)]) if R else torch.zeros(0, k, dtype=torch.long)
        ids[torch.rand(ids.shape) < 0.15] = -1
    return ids.to(device), torch.rand(ids.shape, device=device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("R,E,k,H,I", [(1, 4, 2, 32, 16), (37, 8, 3, 48, 40), (5, 16, 4, 64, 32)])
def test_fused_moe_fp32_equals_reference(R, E, k, H, I, device):
    ex = _experts(E, H, I, torch.float32, device)
    x = torch.randn(R, H, device=device)
    ids, w = _routing(R, E, k, device)
    out = poisoned(R, H, device=device)
    got = fused_moe(x, ex.w13.data, ex.w2.data, ids, w, tiles=TILES, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = ex.forward_reference(x, ids, w)
    assert _rel(got, ref) <= 1e-4 and torch.isfinite(got).all()


def test_segments_zero_single_and_ragged(device):
    """Expert 0: no tokens; 1: a single one; 2: 17 (one past a block of 16); 3: exactly 32; 4: 5."""
    counts = [0, 1, 17, 32, 5]
    E, H, I = len(counts), 32, 48
    ex = _experts(E, H, I, torch.float32, device)
    ids, w = _routing(sum(counts), E, 1, device, counts)
    x = torch.randn(ids.shape[0], H, device=device)
    align = align_by_expert(ids.to(torch.int32), E, TILES.block_m)
    assert align.counts.tolist() == counts
    assert int(align.num_padded) == sum(-(-n // 16) * 16 for n in counts)
    act = moe_gate_up(x, ex.w13.data, align, 1, TILES, out=poisoned(align.max_rows, I, device=device))
    npad = int(align.num_padded)
    pairs = align.sorted_pairs[:npad].long()
    real = pairs < ids.numel()
    # per-row reference of the fused activation, and zeros on padding rows
    e_rows = align.block_expert.repeat_interleave(16)[:npad].long()
    h = torch.einsum("mh,mnh->mn", x[pairs.clamp(max=ids.numel() - 1)], ex.w13.data[e_rows])
    gate, up = h.chunk(2, dim=-1)
    ref_act = torch.where(real[:, None], torch.nn.functional.silu(gate) * up, 0.0)
    assert _rel(act[:npad], ref_act) <= 1e-5
    y = moe_down(act, ex.w2.data, align, w.float().contiguous(), TILES, out=poisoned(ids.numel(), H, device=device))
    out = moe_sum(y, ids.to(torch.int32).contiguous(), out=poisoned(ids.shape[0], H, device=device))
    assert _rel(out, ex.forward_reference(x, ids, w)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_half_precision(dtype, device):
    R, E, k, H, I = 24, 8, 2, 64, 32
    ex = _experts(E, H, I, torch.float32, device)
    x = torch.randn(R, H, device=device)
    ids, w = _routing(R, E, k, device)
    ref = ex.forward_reference(x, ids, w)
    got = fused_moe(x.to(dtype), ex.w13.data.to(dtype), ex.w2.data.to(dtype), ids, w, tiles=TILES,
                    out=poisoned(R, H, dtype=dtype, device=device))
    assert got.dtype == dtype and _rel(got, ref) <= 2e-2


def test_all_slots_remote_gives_zeros(device):
    ex = _experts(4, 32, 16, torch.float32, device)
    ids = torch.full((3, 2), -1, device=device)
    got = fused_moe(torch.randn(3, 32, device=device), ex.w13.data, ex.w2.data, ids, torch.rand(3, 2, device=device),
                    tiles=TILES, out=poisoned(3, 32, device=device))
    assert torch.equal(got, torch.zeros_like(got))


def test_launchers_reject_bad_inputs(device):
    E, H, I = 4, 32, 16
    ex = _experts(E, H, I, torch.float32, device)
    w13, w2 = ex.w13.data, ex.w2.data
    x = torch.randn(5, H, device=device)
    ids, w = _routing(5, E, 2, device)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(torch.randn(H, 5, device=device).t(), w13, w2, ids, w, tiles=TILES)
    with pytest.raises(ValueError, match=r"w13 must be a contiguous \[El, 2I, H=32\]"):
        fused_moe(x, w13[:, :, :16].contiguous(), w2, ids, w, tiles=TILES)
    with pytest.raises(ValueError, match="activation dtype"):
        fused_moe(x, w13.half(), w2, ids, w, tiles=TILES)
    with pytest.raises(ValueError, match="no w13_scale"):
        fused_moe(x, w13.to(torch.float8_e4m3fn), w2, ids, w, tiles=TILES)
    with pytest.raises(ValueError, match=r"must both be \[R=5, k\]"):
        fused_moe(x, w13, w2, ids[:4], w[:4], tiles=TILES)
    with pytest.raises(ValueError, match="integer"):
        fused_moe(x, w13, w2, ids.float(), w, tiles=TILES)
    with pytest.raises(ValueError, match="dtype torch.int64 is not one of"):
        fused_moe(x.long(), w13, w2, ids, w, tiles=TILES)
    with pytest.raises(ValueError, match="out buffer must be"):
        fused_moe(x, w13, w2, ids, w, tiles=TILES, out=torch.empty(5, H + 1, device=device))
    with pytest.raises(ValueError, match="power of two"):
        MoETiles(16, 24, 16)
