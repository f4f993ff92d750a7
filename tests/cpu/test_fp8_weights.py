"""The C kernels with FP8 block-quantised weights (e4m3 + float32 scales per block, read as stored:
csrc/gemm_fp8.c) == float32 torch references on the dequantised weights (moe/fp8.py dequantize_fp8_block,
which is exact in float32), on odd shapes: M = 1, 3, 17, N and K not multiples of the block, partial edge
blocks, blocks other than 128 x 128. The kernel widens every weight to exactly the reference's float32 value,
so only the order of the float32 additions differs: tight tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import gemm
from wideep.cpu.build import unusable
from wideep.moe.experts import Experts
from wideep.moe.fp8 import FP8_DTYPE, dequantize_experts_fp8, dequantize_fp8_block, quantize_experts_fp8, quantize_fp8_block

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)


def _tol(K: int) -> dict:
    return dict(atol=2e-5 * K ** 0.5, rtol=1e-5)


def test_every_e4m3_value_widens_exactly():
    """All 254 finite e4m3 values (subnormals included), times a scale, through the kernel's dequantiser and
    GEMM (an identity-like x picks out each weight)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                       # NaN bytes: no quantiser writes them
    w = codes.view(FP8_DTYPE).view(1, -1).repeat(16, 1)[:, :240].contiguous()   # [16, 240]
    s = torch.tensor([[0.75, 3.0]] * 1)                         # one block row of 16 x 128 / 16 x 112
    want = dequantize_fp8_block(w, s, (16, 128))
    assert torch.equal(gemm.dequantize_fp8(w, s, (16, 128)), want)
    got = gemm.linear_fp8(torch.eye(240)[:7], w, s, (16, 128))  # y[m, n] = W[n, m]
    assert torch.equal(got, want[:, :7].t())


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize("N,K,block", [(1, 16, (128, 128)), (3, 17, (128, 128)), (37, 33, (128, 128)),
                                       (130, 257, (128, 128)), (576, 200, (128, 128)), (67, 300, (32, 64)),
                                       (45, 130, (7, 16))])
def test_linear_fp8_against_the_dequantised_reference(M, N, K, block):
    torch.manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K)
    q, s = quantize_fp8_block(torch.randn(N, K) * 0.1, block)
    ref = F.linear(x, dequantize_fp8_block(q, s, block))
    got = gemm.linear_fp8(x, q, s, block)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got, ref, **_tol(K))


def test_linear_fp8_strided_and_bfloat16_activations():
    torch.manual_seed(1)
    q, s = quantize_fp8_block(torch.randn(70, 150), (128, 128))
    big = torch.randn(9, 200)
    x = big[:, 10:160]                                          # rows 200 apart
    torch.testing.assert_close(gemm.linear_fp8(x, q, s), F.linear(x, dequantize_fp8_block(q, s)), **_tol(150))
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(gemm.linear_fp8(xb, q, s), F.linear(xb.float(), dequantize_fp8_block(q, s)),
                               **_tol(150))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_equals_the_reference(dtype):
    torch.manual_seed(2)
    q, s = quantize_fp8_block(torch.randn(130, 301), (128, 128))
    assert torch.equal(gemm.dequantize_fp8(q, s, (128, 128), dtype), dequantize_fp8_block(q, s, (128, 128), dtype))


@pytest.mark.parametrize("T,k", [(1, 2), (3, 3), (17, 4)])
@pytest.mark.parametrize("H,I,block", [(64, 48, (128, 128)), (200, 136, (128, 128)), (96, 40, (32, 32))])
def test_experts_fp8_against_the_dequantised_reference(T, k, H, I, block):
    torch.manual_seed(T + k + H + I)
    El = 5
    q13, s13, q2, s2 = quantize_experts_fp8(torch.randn(El, 2 * I, H) * 0.1, torch.randn(El, H, I) * 0.1, block)
    w13, w2 = dequantize_experts_fp8(q13, s13, q2, s2, block)
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(El)[:k] for _ in range(T)])   # distinct experts per token, as a router picks
    ids[torch.rand(T, k) < 0.2] = -1                                  # some on another rank
    wts = torch.rand(T, k)
    ref = Experts(El, H, I, backend="reference")
    with torch.no_grad():
        ref.w13.copy_(w13)
        ref.w2.copy_(w2)
    want = ref(x, ids, wts)
    got = gemm.experts(x, q13, q2, ids, wts, w13_scale=s13, w2_scale=s2, block=block)
    torch.testing.assert_close(got, want, **_tol(H + I))


@pytest.mark.parametrize("backend", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_token_fp8_linear_reads_no_weight(backend, dtype, monkeypatch):
    """An idle EP rank's step has no tokens but runs every layer (its experts serve the other ranks): an fp8 linear
    of zero rows returns [..., 0 rows, N] without a dequantised copy of the weight, on the CPU kernel and on torch."""
    from wideep.cpu.linear import small_linear_fp8
    from wideep.moe import fp8_linear
    from wideep.moe.fp8_linear import Fp8Linear

    def never(*args, **kwargs):
        raise AssertionError("a zero-token step dequantised an fp8 weight")
    monkeypatch.setattr(gemm, "dequantize_fp8", never)
    monkeypatch.setattr(fp8_linear, "dequantize_fp8_block", never)
    q, s = quantize_fp8_block(torch.randn(96, 64), (32, 32))
    lin = Fp8Linear(64, 96, bias=False, dtype=dtype, block=(32, 32), backend="torch",
                    kernel=small_linear_fp8 if backend == "kernel" else None)
    with torch.no_grad():
        lin.weight.copy_(q), lin.weight_scale_inv.copy_(s)
    for shape in ((0, 64), (1, 0, 64)):
        y = lin(torch.randn(shape, dtype=dtype))
        assert y.shape == (*shape[:-1], 96) and y.dtype == dtype


def test_bad_fp8_inputs_are_clear_errors():
    q, s = quantize_fp8_block(torch.randn(40, 64), (32, 32))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm.linear_fp8(x, q, s, (32, 24))
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        gemm.linear_fp8(x, q, s[:, :1].contiguous(), (32, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemm.linear_fp8(x, q.float(), s, (32, 32))
    with pytest.raises(ValueError, match="same K"):
        gemm.linear_fp8(torch.randn(2, 63), q, s, (32, 32))
    with pytest.raises(ValueError, match="block must be two positive ints"):
        gemm.linear_fp8(x, q, s, (0, 32))
    q13, s13, q2, s2 = quantize_experts_fp8(torch.randn(2, 32, 64), torch.randn(2, 64, 16), (32, 32))
    ids, wts = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="need w13_scale"):
        gemm.experts(x[:1], q13, q2, ids, wts)
    with pytest.raises(ValueError, match="w13_scale is"):
        gemm.experts(x[:1], q13, q2, ids, wts, w13_scale=s13[:, :1].contiguous(), w2_scale=s2, block=(32, 32))
    with pytest.raises(ValueError, match="scales are for float8_e4m3fn"):
        gemm.experts(x[:1], q13.float(), q2.float(), ids, wts, w13_scale=s13, w2_scale=s2, block=(32, 32))


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 builds only")
def test_a_build_without_avx512_widens_exactly_too(monkeypatch, tmp_path):
    """Built for AVX2 (x86-64-v3), the dequantiser's e4m3 widening is the integer form instead of AVX-512's
    vcvtph2ps (the GEMM is gemm_fp8_avx2.c's, on F16C): every value, subnormals included, still exactly the
    reference's."""
    import ctypes
    from wideep.cpu import build
    monkeypatch.setattr(build, "FLAGS", build.flags("x86-64-v3"))
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    lib = build.build("wideep_cpu_x86_64_v3", build.sources())
    if build.missing_isa("x86-64-v3"):
        pytest.skip(f"built for x86-64-v3; not run: this CPU lacks {build.missing_isa('x86-64-v3')}")
    lib.wd_linear_fp8.argtypes, lib.wd_linear_fp8.restype = [ctypes.POINTER(gemm.LinearFp8Args)], ctypes.c_int64
    codes = torch.arange(256, dtype=torch.uint8)
    w = codes[(codes & 0x7F) != 0x7F].view(FP8_DTYPE).view(2, 127).contiguous()
    s = torch.tensor([[0.5]])
    want = dequantize_fp8_block(w, s, (16, 128))
    y = torch.empty(2, 127)
    assert lib.wd_linear_fp8(gemm.LinearFp8Args(w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(), N=2, K=127, ldw=127,
                                                lds=1, ldy=127, br=16, bk=128)) == 0
    assert torch.equal(y, want)
    x = torch.randn(5, 127)
    assert lib.wd_linear_fp8(gemm.LinearFp8Args(x=x.data_ptr(), w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(), M=5,
                                                N=2, K=127, ldx=127, ldw=127, lds=1, ldy=2, br=16, bk=128)) == 0
    torch.testing.assert_close(y.view(-1)[:10].view(5, 2), F.linear(x, want), **_tol(127))
