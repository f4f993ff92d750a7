"""FP8 experts: the Triton path with in-kernel block dequantisation, the per-token-group activation
quantiser, and the DeepGEMM layouts driven through fake deep_gemm modules of both API generations.
The Triton interpreter handles float8_e4m3fn loads and stores (checked here), so the fp8 kernels
themselves run on CPU."""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from wideep.moe import deepgemm  # noqa: E402
from wideep.moe.experts import Experts  # noqa: E402
from wideep.moe.fp8 import (FP8_DTYPE, dequantize_experts_fp8, dequantize_fp8_block, quantize_experts_fp8,  # noqa: E402
                     quantize_per_token_group)
from wideep.moe.tiles import MoETiles  # noqa: E402
from wideep.moe.triton_moe import fused_moe  # noqa: E402
from wideep.moe.triton_quant import per_token_group_quant_fp8  # noqa: E402
from tests.kernels.conftest import poisoned  # noqa: E402

TILES = MoETiles(16, 16, 16, group_m=2, num_warps=1, num_stages=1)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def _fp8_experts(E, H, I, block, device):
    w13 = torch.randn(E, 2 * I, H, device=device) * H ** -0.5
    w2 = torch.randn(E, H, I, device=device) * I ** -0.5
    q13, s13, q2, s2 = quantize_experts_fp8(w13, w2, block)
    ex = Experts(E, H, I, device=device, dtype=torch.float32, fp8_block=block)
    with torch.no_grad():
        ex.w13.copy_(q13), ex.w13_scale_inv.copy_(s13), ex.w2.copy_(q2), ex.w2_scale_inv.copy_(s2)
    return ex


def _routing(R, E, k, device):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(R)])
    ids[torch.rand(R, k) < 0.15] = -1
    return ids.to(device), torch.rand(R, k, device=device)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_fp8_weights_equal_dequantised_reference(dtype, tol, device):
    """Partial quantisation blocks on both axes (H=80, I=48 in 32x32 blocks)."""
    E, H, I, block = 6, 80, 48, (32, 32)
    ex = _fp8_experts(E, H, I, block, device)
    assert ex.w13.dtype == FP8_DTYPE and tuple(ex.w13_scale_inv.shape) == (E, 4, 3)
    x = torch.randn(19, H, device=device)
    ids, w = _routing(19, E, 3, device)
    ref = ex.forward_reference(x, ids, w)                      # fp32 on the dequantised weights
    got = fused_moe(x.to(dtype), ex.w13, ex.w2, ids, w, w13_scale=ex.w13_scale_inv, w2_scale=ex.w2_scale_inv,
                    quant_block=block, tiles=TILES, out=poisoned(19, H, dtype=dtype, device=device))
    assert _rel(got, ref) <= tol


def test_experts_module_triton_backend_with_fp8(device):
    ex = _fp8_experts(4, 64, 32, (32, 32), device)
    x = torch.randn(9, 64, device=device)
    ids, w = _routing(9, 4, 2, device)
    ex.backend = "triton"
    assert _rel(ex(x, ids, w), ex.forward_reference(x, ids, w)) <= 1e-4


@pytest.mark.parametrize("M,K,group", [(5, 256, 128), (3, 100, 32), (1, 7, 128)])
def test_per_token_group_quant_matches_reference(M, K, group, device):
    x = torch.randn(M, K, device=device) * torch.logspace(-2, 2, M, device=device)[:, None]
    q, s = per_token_group_quant_fp8(x, group, out_q=poisoned(M, K, dtype=FP8_DTYPE, device=device),
                                     out_scale=poisoned(M, -(-K // group), device=device))
    rq, rs = quantize_per_token_group(x, group)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), rq.float())               # same e4m3 rounding (ties have measure zero)
    deq = q.float() * s.repeat_interleave(group, 1)[:, :K]
    assert _rel(deq, x) < 0.05  # e4m3 keeps ~3 mantissa bits


def test_quant_rejects_bad_inputs():
    with pytest.raises(ValueError, match="contiguous"):
        per_token_group_quant_fp8(torch.randn(8, 6).t())
    with pytest.raises(ValueError, match="cannot be quantised"):
        per_token_group_quant_fp8(torch.zeros(2, 4, dtype=torch.int32))


# -- DeepGEMM, through fake modules that compute what DeepGEMM computes -------------------------
def _deq_lhs(q, s):
    return q.float() * s.repeat_interleave(128, -1)[..., :q.shape[-1]]


def _deq_rhs(q, s):
    return torch.stack([dequantize_fp8_block(qe, se) for qe, se in zip(q, s)])


def _check_operands(lhs, rhs, out, column_major: bool):
    assert lhs[0].dtype == FP8_DTYPE and rhs[0].dtype == FP8_DTYPE and out.dtype == torch.bfloat16
    assert lhs[1].dtype == torch.float32 and lhs[1].shape[-1] == -(-lhs[0].shape[-1] // 128)
    if column_major:  # v1 insists on its TMA layout for the lhs scales
        assert lhs[1].stride(-2) == 1, "v1 lhs scales must be column-major"


def _fake(generation: str, log: list):
    def contiguous(lhs, rhs, out, m_indices):
        _check_operands(lhs, rhs, out, generation == "v1")
        assert m_indices.dtype == torch.int32 and m_indices.shape[0] == lhs[0].shape[0] == out.shape[0]
        if generation == "v1":
            assert (m_indices >= 0).all(), "v1 has no padding rows past the segments"
        a, w = _deq_lhs(*lhs), _deq_rhs(*rhs)
        for m in torch.nonzero(m_indices >= 0).squeeze(1).tolist():
            out[m] = (a[m] @ w[m_indices[m]].t()).to(torch.bfloat16)
        log.append("contiguous")

    def masked(lhs, rhs, out, masked_m, expected_m):
        _check_operands(lhs, rhs, out, generation == "v1")
        assert masked_m.dtype == torch.int32 and isinstance(expected_m, int) and expected_m >= 1
        a, w = _deq_lhs(*lhs), _deq_rhs(*rhs)
        for g, n in enumerate(masked_m.tolist()):
            out[g, :n] = (a[g, :n] @ w[g].t()).to(torch.bfloat16)
        log.append("masked")

    names = deepgemm.GENERATIONS[generation]
    mod = types.SimpleNamespace(**{names[0]: contiguous, names[1]: masked, names[2]: lambda: 128})
    if generation == "v1":
        mod.get_col_major_tma_aligned_tensor = lambda s: s.transpose(-1, -2).contiguous().transpose(-1, -2)
    return mod


def test_probe_finds_each_generation_by_name():
    log = []
    assert deepgemm.probe(types.SimpleNamespace()) is None
    assert deepgemm.probe(types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=None)) is None  # not callable
    v1, v2 = deepgemm.probe(_fake("v1", log)), deepgemm.probe(_fake("v2", log))
    assert (v1.generation, v2.generation) == ("v1", "v2")
    assert v1.scale_layout is not None and v2.scale_layout is None
    both = types.SimpleNamespace(**vars(_fake("v1", log)), **vars(_fake("v2", log)))
    assert deepgemm.probe(both).generation == "v2"
    only_contig = types.SimpleNamespace(m_grouped_gemm_fp8_fp8_bf16_nt_contiguous=lambda *a: None)
    api = deepgemm.probe(only_contig)
    assert api.masked is None and api.alignment == 128


@pytest.mark.parametrize("generation", ["v1", "v2"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_deepgemm_layouts_equal_reference(generation, layout):
    E, H, I = 4, 256, 128
    ex = _fp8_experts(E, H, I, (128, 128), "cpu")
    ex.backend, log = "deepgemm", []
    ex.deepgemm = deepgemm.probe(_fake(generation, log))
    R = 300 if layout == "contiguous" else 7                 # MASKED_MAX_ROWS = 256 splits the two
    x = torch.randn(R, H)
    ids, w = _routing(R, E, 2, "cpu")
    ids[0] = -1                                              # a row with no local expert
    got = ex(x.to(torch.bfloat16), ids, w)
    assert log == [layout, layout]
    ref = ex.forward_reference(x, ids, w)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert _rel(got, ref) < 0.05                               # fp8 activations: ~3 mantissa bits
    assert got[0].abs().max() == 0


def test_dequantize_experts_roundtrip():
    w13, w2 = torch.randn(2, 40, 24), torch.randn(2, 24, 20)
    back13, back2 = dequantize_experts_fp8(*quantize_experts_fp8(w13, w2, (16, 16)), block=(16, 16))
    assert _rel(back13, w13) < 0.05 and _rel(back2, w2) < 0.05
