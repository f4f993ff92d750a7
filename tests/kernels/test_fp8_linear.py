"""Triton W8A16 linear (fp8 block-scaled weight, dequantised per tile) == F.linear on the dequantised
weight; Fp8Linear's two forwards agree. Partial quantisation blocks on both axes."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wideep.moe.fp8 import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block  # noqa: E402
from wideep.moe.fp8_linear import Fp8Linear  # noqa: E402
from wideep.moe.tiles import MoETiles  # noqa: E402
from wideep.moe.triton_linear import fp8_linear  # noqa: E402
from tests.kernels.conftest import poisoned  # noqa: E402

TILES = MoETiles(16, 16, 16, group_m=2, num_warps=1, num_stages=1)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("M,N,K", [(1, 40, 48), (19, 72, 80), (33, 16, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fp8_linear_equals_dequantised(M, N, K, dtype, tol, device):
    block = (32, 32)
    q, s = quantize_fp8_block(torch.randn(N, K, device=device) * K ** -0.5, block)
    x = torch.randn(M, K, device=device)
    ref = x @ dequantize_fp8_block(q, s, block).t()
    got = fp8_linear(x.to(dtype), q, s, block, tiles=TILES, out=poisoned(M, N, dtype=dtype, device=device))
    assert got.dtype == dtype and _rel(got, ref) <= tol


def test_module_forwards_agree(device):
    lin = Fp8Linear(48, 40, bias=True, device=device, dtype=torch.float32, block=(32, 32))
    q, s = quantize_fp8_block(torch.randn(40, 48, device=device) * 0.2, (32, 32))
    with torch.no_grad():
        lin.weight.copy_(q), lin.weight_scale_inv.copy_(s), lin.bias.normal_()
    assert lin.weight.dtype == FP8_DTYPE and tuple(lin.weight_scale_inv.shape) == (2, 2)
    x = torch.randn(3, 5, 48, device=device)
    lin.backend = "torch"
    ref = lin(x)
    lin.backend = "triton"
    got = lin(x)
    assert got.shape == (3, 5, 40) and _rel(got, ref) <= 1e-5


def test_fp8_linear_rejects_bad_inputs(device):
    q, s = quantize_fp8_block(torch.randn(40, 48, device=device), (32, 32))
    x = torch.randn(4, 48, device=device)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, q.float(), s, (32, 32))
    with pytest.raises(ValueError, match=r"scale_inv must be a contiguous fp32 \(2, 2\)"):
        fp8_linear(x, q, s[:1].contiguous(), (32, 32))
    with pytest.raises(ValueError, match="contiguous"):
        fp8_linear(torch.randn(48, 4, device=device).t(), q, s, (32, 32))
    with pytest.raises(ValueError, match=r"\[N, K=40\]"):
        fp8_linear(x[:, :40].contiguous(), q, s, (32, 32))
