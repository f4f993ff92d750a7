"""The kernels built for AVX2 + FMA without AVX-512 (-march=x86-64-v3: csrc/gemm_avx2.c's 8-float GEMM instead of
gemm_tpl.h's 16-float one) == float64 torch references: the streamed GEMM on odd shapes (M 1 .. 33, N not a
multiple of 4, K not a multiple of 8 and K < 8), float32 and bfloat16 weights (widened: the library's AVX512-BF16
and AMX paths off), strided x, w and y; bmm_nt's batches; the routed experts on that GEMM. Skipped unless this
CPU has AVX2 and FMA (the tests never run an instruction the host lacks)."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import build, gemm
from wideep.moe.experts import Experts


def _has_avx2_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


pytestmark = [pytest.mark.skipif(not _has_avx2_fma(), reason="this CPU has no AVX2 + FMA (or is not x86-64)"),
              pytest.mark.skipif(build.unusable() is not None, reason=f"CPU kernels not built: {build.unusable()}")]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "FLAGS", build.flags("x86-64-v3"))
        mp.setenv("WIDEEP_CACHE_DIR", str(tmp_path_factory.mktemp("avx2")))
        lib = build.build("wideep_cpu_x86_64_v3", build.sources())
    for name, cls in (("wd_bmm_nt", gemm.BmmNtArgs), ("wd_experts", gemm.ExpertsArgs),
                      ("wd_bf16_dot", gemm.Bf16DotArgs), ("wd_amx", gemm.AmxArgs)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.POINTER(cls)], ctypes.c_int64
    # bfloat16 weights on the widening path, whatever this CPU has
    assert lib.wd_bf16_dot(gemm.Bf16DotArgs(want=0)) == 0
    assert lib.wd_amx(gemm.AmxArgs(want=0)) == 0
    return lib


def _tol(K: int) -> dict:
    return dict(atol=2e-5 * K ** 0.5, rtol=1e-5)


def _bmm(lib, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """y [B, M, N] = x [B, M, K] @ w [B, N, K]^T through the library's wd_bmm_nt, every stride as given"""
    B, M, K = x.shape
    assert lib.wd_bmm_nt(gemm.BmmNtArgs(x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), B=B, sxb=x.stride(0),
                                        ldx=x.stride(1), swb=w.stride(0), ldw=w.stride(1), syb=y.stride(0),
                                        ldy=y.stride(1), M=M, N=w.shape[1], K=K, wdt=gemm.WDT[w.dtype],
                                        xdt=gemm.WDT[x.dtype])) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 9, 33])
@pytest.mark.parametrize("N,K", [(1, 1), (3, 5), (5, 7), (4, 8), (7, 9), (13, 17), (6, 100), (67, 48), (130, 259)])
def test_linear_equals_float64(lib, dtype, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    xb = torch.randn(M, K + 5, generator=g)
    wb = torch.randn(N, K + 3, generator=g).to(dtype)
    x, w = xb[:, 2:2 + K], wb[:, 1:1 + K]                  # rows K + 5 and K + 3 apart: ldx, ldw > K
    yb = torch.full((M, N + 2), float("nan"))
    y = yb[:, :N]                                           # rows N + 2 apart; the padding must stay untouched
    _bmm(lib, x[None], w[None], y[None])
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), **_tol(K))
    assert yb[:, N:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_nt_batches_and_bfloat16_x(lib, dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 6, 2, 37, generator=g)[:, :, 1]       # [3, 6, 37]: batch stride 444, row stride 74
    w = torch.randn(3, 11, 37, generator=g).to(dtype)
    y = torch.empty(3, 6, 11)
    _bmm(lib, x, w, y)
    torch.testing.assert_close(y, (x.double() @ w.double().transpose(1, 2)).float(), **_tol(37))
    xh = x.to(torch.bfloat16)                                # widened exactly, then the same GEMM
    _bmm(lib, xh, w, y)
    torch.testing.assert_close(y, (xh.double() @ w.double().transpose(1, 2)).float(), **_tol(37))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,H,I", [(1, 4, 2, 24, 8), (7, 5, 2, 40, 20), (33, 8, 3, 64, 36)])
def test_experts_equal_reference(lib, dtype, T, E, k, H, I):
    g = torch.Generator().manual_seed(T + E)
    ex = Experts(E, H, I)
    ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.2)
    ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.2)
    w13, w2 = ex.w13.to(dtype).contiguous(), ex.w2.to(dtype).contiguous()
    ex.w13.copy_(w13.float())                                # the reference on the very weights the kernel reads
    ex.w2.copy_(w2.float())
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[torch.rand(T, k, generator=g) < 0.2] = -1            # slots whose expert lives on another rank
    wts = torch.rand(T, k, generator=g)
    out = torch.zeros(T, H)
    iscratch = torch.empty(2 * (E + 1) + T * k, dtype=torch.int64)
    scratch = torch.empty(T * (2 * H + 3 * I))
    assert lib.wd_experts(gemm.ExpertsArgs(x=x.data_ptr(), w13=w13.data_ptr(), w2=w2.data_ptr(), wts=wts.data_ptr(),
                                           ids=ids.data_ptr(), out=out.data_ptr(), scratch=scratch.data_ptr(),
                                           iscratch=iscratch.data_ptr(), T=T, H=H, I=I, El=E, k=k,
                                           wdt=gemm.WDT[dtype], xdt=0)) == 0
    torch.testing.assert_close(out, ex.forward_reference(x, ids, wts), atol=1e-5, rtol=1e-5)
