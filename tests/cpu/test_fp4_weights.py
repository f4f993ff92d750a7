"""The C kernels with FP4 weights (e2m1 pairs + an e8m0 scale byte per 32 values along K, read as stored:
csrc/gemm_fp4.c) == float32 torch references on the dequantised weights (moe/fp4.py dequantize_fp4, exact in
float32), on odd shapes: M = 1..5, 17, N not a multiple of 4, K = 32 .. 544; every e2m1 code, zeros, negatives,
the largest value (+-6) and extreme scales; the experts kernel with and without DeepSeek-V4's clamped SwiGLU;
the AVX2 build (no AVX-512: the integer widening) as well as this CPU's."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import gemm
from wideep.cpu.build import unusable
from wideep.moe.experts import Experts
from wideep.moe.fp4 import dequantize_fp4, pack_fp4

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)


def _tol(K: int) -> dict:
    return dict(atol=2e-5 * K ** 0.5, rtol=1e-5)


def _random_fp4(N: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [N, K/2] uint8 of random codes, e8m0 scales [N, K/32] uint8 around 2^-3"""
    codes = torch.randint(0, 16, (N, K), generator=gen)
    return pack_fp4(codes), torch.randint(120, 127, (N, K // 32), generator=gen, dtype=torch.uint8)


def _every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """[16, 64]: each row all 16 codes (x4, shuffled per row), scales 0 (2^-127), 1, 100, 127 (1), 140, 252 (2^125: 6 x it is near the float32 maximum)"""
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.arange(16).repeat(4)[torch.randperm(64, generator=g)] for _ in range(16)])
    scales = torch.tensor([0, 1, 100, 127, 140, 252, 127, 127] * 4, dtype=torch.uint8).view(16, 2)
    return pack_fp4(codes), scales


def test_every_e2m1_code_and_extreme_scales_widen_exactly():
    w, s = _every_code_and_scale()
    want = dequantize_fp4(w, s)
    assert want.abs().max() == 6.0 * 2.0 ** 125 and (want == 0).any() and (want < 0).any()
    got = gemm.dequantize_fp4(w, s)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), "code 8 is -0.0"
    assert torch.equal(gemm.dequantize_fp4(w, s, torch.bfloat16), want.to(torch.bfloat16))
    for M in (2, 9):                                            # the row path and the 4-row blocks
        got = gemm.linear_fp4(torch.eye(64)[:M], w, s)          # y[m, n] = W[n, m]
        assert torch.equal(got, want[:, :M].t())


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize("N,K", [(1, 32), (3, 64), (37, 96), (130, 544), (4, 32), (9, 160)])
def test_linear_fp4_against_the_dequantised_reference(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w, s = _random_fp4(N, K, g)
    x = torch.randn(M, K, generator=g)
    ref = F.linear(x, dequantize_fp4(w, s))
    got = gemm.linear_fp4(x, w, s)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got, ref, **_tol(K))


def test_linear_fp4_strided_and_bfloat16_activations():
    g = torch.Generator().manual_seed(1)
    w, s = _random_fp4(70, 128, g)
    x = torch.randn(9, 200, generator=g)[:, 10:138]             # rows 200 apart
    torch.testing.assert_close(gemm.linear_fp4(x, w, s), F.linear(x, dequantize_fp4(w, s)), **_tol(128))
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(gemm.linear_fp4(xb, w, s), F.linear(xb.float(), dequantize_fp4(w, s)), **_tol(128))


def _fp4_experts(El: int, H: int, I: int, gen: torch.Generator):
    w13, s13 = _random_fp4(El * 2 * I, H, gen)
    w2, s2 = _random_fp4(El * H, I, gen)
    return (w13.view(El, 2 * I, H // 2), s13.view(El, 2 * I, H // 32), w2.view(El, H, I // 2),
            s2.view(El, H, I // 32))


@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("T,k", [(1, 2), (3, 3), (17, 4)])
@pytest.mark.parametrize("H,I", [(64, 32), (160, 96), (32, 64)])
def test_experts_fp4_against_the_dequantised_reference(T, k, H, I, limit):
    g = torch.Generator().manual_seed(T + k + H + I)
    El = 5
    w13, s13, w2, s2 = _fp4_experts(El, H, I, g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(El, generator=g)[:k] for _ in range(T)])
    ids[torch.rand(T, k, generator=g) < 0.2] = -1                 # some on another rank
    wts = torch.rand(T, k, generator=g)
    ref = Experts(El, H, I, backend="reference", limit=limit)
    with torch.no_grad():
        ref.w13.copy_(dequantize_fp4(w13.reshape(-1, H // 2), s13.reshape(-1, H // 32)).view(El, 2 * I, H))
        ref.w2.copy_(dequantize_fp4(w2.reshape(-1, I // 2), s2.reshape(-1, I // 32)).view(El, H, I))
    want = ref(x, ids, wts)
    got = gemm.experts(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, limit=limit)
    # float32 sums in another order, on outputs of up to ~100: relative to the largest
    torch.testing.assert_close(got, want, atol=2e-6 * (H + I) ** 0.5 * want.abs().max().item(), rtol=1e-5)
    if limit is not None:   # the clamp matters on these weights: without it the sums differ
        plain = gemm.experts(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2)
        assert (plain - want).abs().max() > 1e-3


def test_bad_fp4_inputs_are_clear_errors():
    g = torch.Generator().manual_seed(3)
    w, s = _random_fp4(8, 64, g)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm.linear_fp4(torch.randn(2, 48), w[:, :24].contiguous(), s[:, :1].contiguous())
    with pytest.raises(ValueError, match=r"shape \(8, 2\)"):
        gemm.linear_fp4(x, w, s[:, :1].contiguous())
    with pytest.raises(ValueError, match="uint8 CPU tensor of e2m1 pairs"):
        gemm.linear_fp4(x, w.view(torch.int8), s)
    with pytest.raises(ValueError, match="same K"):
        gemm.linear_fp4(torch.randn(2, 32), w, s)
    w13, s13, w2, s2 = _fp4_experts(2, 64, 32, g)
    ids, wts = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="need w13_scale and w2_scale"):
        gemm.experts(x[:1], w13, w2, ids, wts)
    with pytest.raises(ValueError, match="limit must be > 0"):
        gemm.experts(x[:1], w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, limit=0.0)
    with pytest.raises(ValueError, match=r"must be \[T, H\], \[El, 2I, H/2\]"):
        gemm.experts(x[:1], w13, w2[:, :32].contiguous(), ids, wts, w13_scale=s13, w2_scale=s2[:, :32].contiguous())
    for bad in (dict(H=48), dict(I=48)):   # the C refuses what the launcher would: nothing computed
        a = gemm.ExpertsArgs(T=1, H=64, I=32, El=2, k=1, wdt=gemm.WD_FP4, s13=s13.data_ptr(), s2=s2.data_ptr())
        for name, v in bad.items():
            setattr(a, name, v)
        assert gemm.library().wd_experts(a) == -(1 << 63)
    assert gemm.library().wd_linear_fp4(gemm.LinearFp4Args(N=1, K=48)) == -1


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 builds only")
def test_a_build_without_avx512_widens_exactly_too(monkeypatch, tmp_path):
    """Built for AVX2 (x86-64-v3), the e2m1 widening is the integer form instead of vpermps: every code and
    extreme scale still exactly the reference's, and the GEMM and the experts (clamped) match it."""
    from wideep.cpu import build
    monkeypatch.setattr(build, "FLAGS", build.flags("x86-64-v3"))
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    lib = build.build("wideep_cpu_x86_64_v3", build.sources())
    if build.missing_isa("x86-64-v3"):
        pytest.skip(f"built for x86-64-v3; not run: this CPU lacks {build.missing_isa('x86-64-v3')}")
    lib.wd_linear_fp4.argtypes, lib.wd_linear_fp4.restype = [ctypes.POINTER(gemm.LinearFp4Args)], ctypes.c_int64
    lib.wd_experts.argtypes, lib.wd_experts.restype = [ctypes.POINTER(gemm.ExpertsArgs)], ctypes.c_int64
    w, s = _every_code_and_scale()
    want = dequantize_fp4(w, s)
    y = torch.empty(16, 64)
    assert lib.wd_linear_fp4(gemm.LinearFp4Args(w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(), N=16, K=64, ldw=32,
                                                lds=2, ldy=64)) == 0
    assert torch.equal(y, want)
    for M in (2, 9):   # the row path and the 4-row blocks, through an identity-like x: exact
        x, y, xp = torch.eye(64)[:M].contiguous(), torch.empty(M, 16), torch.empty(gemm.fp4_xp(M, 64))
        assert lib.wd_linear_fp4(gemm.LinearFp4Args(x=x.data_ptr(), w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(),
                                                    xp=xp.data_ptr(), M=M, N=16, K=64, ldx=64, ldw=32, lds=2,
                                                    ldy=16)) == 0
        assert torch.equal(y, want[:, :M].t())
    g = torch.Generator().manual_seed(4)
    w, s = _random_fp4(7, 96, g)
    x = torch.randn(5, 96, generator=g)
    y, xp = torch.empty(5, 7), torch.empty(gemm.fp4_xp(5, 96))
    assert lib.wd_linear_fp4(gemm.LinearFp4Args(x=x.data_ptr(), w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(), M=5,
                                                N=7, K=96, ldx=96, ldw=48, lds=3, ldy=7)) == -1, "no scratch"
    assert lib.wd_linear_fp4(gemm.LinearFp4Args(x=x.data_ptr(), w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(), M=5,
                                                N=7, K=96, ldx=96, ldw=48, lds=3, ldy=7, xp=xp.data_ptr())) == 0
    torch.testing.assert_close(y, F.linear(x, dequantize_fp4(w, s)), **_tol(96))
    # the experts kernel of that build against this build's (already checked against the reference above)
    El, H, I, T, k = 3, 64, 32, 4, 2
    w13, s13, w2, s2 = _fp4_experts(El, H, I, g)
    x = torch.randn(T, H, generator=g)
    ids, wts = torch.tensor([[0, 1], [2, -1], [1, 2], [0, 2]]), torch.rand(T, k, generator=g)
    want = gemm.experts(x, w13, w2, ids, wts, w13_scale=s13, w2_scale=s2, limit=0.7)
    out = torch.zeros(T, H)
    iscratch = torch.empty(2 * (El + 1) + T * k, dtype=torch.int64)
    scratch = torch.empty(T * (2 * H + 3 * I) + gemm.fp4_xp(T * k, max(H, I)))
    assert lib.wd_experts(gemm.ExpertsArgs(x=x.data_ptr(), w13=w13.data_ptr(), w2=w2.data_ptr(), wts=wts.data_ptr(),
                                           ids=ids.data_ptr(), out=out.data_ptr(), scratch=scratch.data_ptr(),
                                           iscratch=iscratch.data_ptr(), s13=s13.data_ptr(), s2=s2.data_ptr(), T=T,
                                           H=H, I=I, El=El, k=k, wdt=gemm.WD_FP4, limit=0.7)) == 0
    torch.testing.assert_close(out, want, **_tol(H + I))
