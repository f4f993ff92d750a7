"""The kernels built for AVX2 + FMA without AVX-512 (-march=x86-64-v3: csrc/gemm_avx2.c's 8-float GEMM instead of
gemm_tpl.h's 16-float one, gemm_fp8_avx2.c's and gemm_fp4_avx2.c's instead of gemm_fp8.c's and gemm_fp4.c's) ==
float64 torch references: the streamed GEMM on odd shapes (M 1 .. 33, N not a multiple of 4, K not a multiple of 8
and K < 8), float32 and bfloat16 weights (widened: the library's AVX512-BF16 and AMX paths off), strided x, w and
y; bmm_nt's batches; the routed experts on that GEMM. FP8 (e4m3 + float32 block scales) and FP4 (e2m1 + e8m0
scales) weights against the same GEMM on their dequantised values (moe/fp8.py, moe/fp4.py): K tails, partial scale
blocks, every e4m3 value and e2m1 code exact through an identity-like x; their routed experts. The paged MLA decode
(mla_decode_avx2.c's loops) over float32, bfloat16, fp8 and fp4 latent caches on odd batches, lengths, heads and
widths against float64 over the same (dequantised) pool. Skipped unless this
CPU has AVX2 and FMA (the tests never run an instruction the host lacks)."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from wideep.attention_mla.fp4_cache import Fp4Latent
from wideep.attention_mla.fp8_cache import Fp8Latent
from wideep.attention_mla.kv_cache import gather_reference
from wideep.cpu import build, gemm, layers
from wideep.moe.experts import Experts
from wideep.moe.fp4 import dequantize_fp4, pack_fp4
from wideep.moe.fp8 import FP8_DTYPE, dequantize_experts_fp8, dequantize_fp8_block, quantize_experts_fp8, quantize_fp8_block


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
                      ("wd_bf16_dot", gemm.Bf16DotArgs), ("wd_amx", gemm.AmxArgs),
                      ("wd_linear_fp8", gemm.LinearFp8Args), ("wd_linear_fp4", gemm.LinearFp4Args)):
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


def _fp8(lib, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block, y: torch.Tensor) -> None:
    """y [M, N] = x [M, K] @ (q [N, K] e4m3 * s)^T through wd_linear_fp8, every row stride as given"""
    assert lib.wd_linear_fp8(gemm.LinearFp8Args(x=x.data_ptr(), w=q.data_ptr(), s=s.data_ptr(), y=y.data_ptr(),
                                                M=x.shape[0], N=q.shape[0], K=x.shape[1], ldx=x.stride(0),
                                                ldw=q.stride(0), lds=s.stride(0), ldy=y.stride(0), br=block[0],
                                                bk=block[1])) == 0


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 9, 33])
@pytest.mark.parametrize("N,K,block", [(1, 16, (128, 128)), (3, 7, (128, 128)), (5, 17, (128, 128)),
                                       (6, 33, (16, 16)), (37, 100, (32, 48)), (67, 300, (7, 64)),
                                       (130, 259, (128, 128)), (9, 200, (4, 80))])
def test_linear_fp8_equals_float64(lib, M, N, K, block):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    xb = torch.randn(M, K + 5, generator=g)
    q, s = quantize_fp8_block(torch.randn(N, K, generator=g) * 0.1, block)
    qb = torch.zeros(N, K + 3, dtype=torch.uint8)
    qb[:, :K] = q.view(torch.uint8)
    x, qs = xb[:, 2:2 + K], qb.view(FP8_DTYPE)[:, :K]      # rows K + 5 and K + 3 apart
    yb = torch.full((M, N + 2), float("nan"))
    _fp8(lib, x, qs, s, block, yb[:, :N])
    want = F.linear(x.double(), dequantize_fp8_block(q, s, block).double()).float()
    torch.testing.assert_close(yb[:, :N], want, **_tol(K))
    assert yb[:, N:].isnan().all()


def test_every_e4m3_value_through_the_fp8_gemm(lib):
    """all 254 finite e4m3 values (subnormals included) times a scale, picked out by an identity-like x: exact"""
    codes = torch.arange(256, dtype=torch.uint8)
    w = codes[(codes & 0x7F) != 0x7F].view(FP8_DTYPE).view(2, 127).repeat(3, 1).contiguous()   # [6, 127]
    s = torch.tensor([[0.75], [3.0]])
    want = dequantize_fp8_block(w, s, (3, 128))
    for M in (2, 5, 127):                                   # the row path, the blocks
        y = torch.empty(M, 6)
        _fp8(lib, torch.eye(127)[:M].contiguous(), w, s, (3, 128), y)
        assert torch.equal(y, want[:, :M].t())


def _run_experts(lib, x, w13, w2, s13, s2, ids, wts, wdt, H, I, El, block=(0, 0), xp=0) -> torch.Tensor:
    T, k = ids.shape
    out = torch.zeros(T, H)
    iscratch = torch.empty(2 * (El + 1) + T * k, dtype=torch.int64)
    scratch = torch.empty(T * (2 * H + 3 * I) + xp)
    assert lib.wd_experts(gemm.ExpertsArgs(x=x.data_ptr(), w13=w13.data_ptr(), w2=w2.data_ptr(), wts=wts.data_ptr(),
                                           ids=ids.data_ptr(), out=out.data_ptr(), scratch=scratch.data_ptr(),
                                           iscratch=iscratch.data_ptr(), s13=s13.data_ptr(), s2=s2.data_ptr(), T=T,
                                           H=H, I=I, El=El, k=k, wdt=wdt, br=block[0], bk=block[1], xdt=0)) == 0
    return out


def _routing(T: int, E: int, k: int, g: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[torch.rand(T, k, generator=g) < 0.2] = -1            # slots whose expert lives on another rank
    return ids, torch.rand(T, k, generator=g)


def _reference(w13: torch.Tensor, w2: torch.Tensor, x, ids, wts) -> torch.Tensor:
    E, I2, H = w13.shape
    ex = Experts(E, H, I2 // 2)
    with torch.no_grad():
        ex.w13.copy_(w13)
        ex.w2.copy_(w2)
        return ex.forward_reference(x, ids, wts)


@torch.no_grad()
@pytest.mark.parametrize("T,E,k,H,I,block", [(1, 4, 2, 48, 16, (128, 128)), (7, 5, 2, 40, 20, (16, 16)),
                                             (33, 8, 3, 64, 36, (32, 48)), (40, 3, 3, 130, 50, (7, 32))])
def test_experts_fp8_equal_reference(lib, T, E, k, H, I, block):
    g = torch.Generator().manual_seed(T + E + H)
    q13, s13, q2, s2 = quantize_experts_fp8(torch.randn(E, 2 * I, H, generator=g) * 0.2,
                                            torch.randn(E, H, I, generator=g) * 0.2, block)
    x = torch.randn(T, H, generator=g)
    ids, wts = _routing(T, E, k, g)
    got = _run_experts(lib, x, q13, q2, s13, s2, ids, wts, gemm.WD_FP8, H, I, E, block)
    torch.testing.assert_close(got, _reference(*dequantize_experts_fp8(q13, s13, q2, s2, block), x, ids, wts),
                               atol=1e-5, rtol=1e-5)


def _random_fp4(N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [N, K/2] uint8 of random codes, e8m0 scales [N, K/32] around 2^-3"""
    return (pack_fp4(torch.randint(0, 16, (N, K), generator=g)),
            torch.randint(120, 127, (N, K // 32), generator=g, dtype=torch.uint8))


def _fp4(lib, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> None:
    M, K = x.shape
    xp = torch.full((gemm.fp4_xp(M, K),), float("nan"))     # scratch: whatever was there before
    assert lib.wd_linear_fp4(gemm.LinearFp4Args(x=x.data_ptr(), w=w.data_ptr(), s=s.data_ptr(), y=y.data_ptr(),
                                                xp=xp.data_ptr(), M=M, N=w.shape[0], K=K, ldx=x.stride(0),
                                                ldw=w.stride(0), lds=s.stride(0), ldy=y.stride(0))) == 0


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 9, 33])
@pytest.mark.parametrize("N,K", [(1, 32), (3, 64), (5, 96), (6, 160), (37, 224), (130, 544)])
def test_linear_fp4_equals_float64(lib, M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    xb = torch.randn(M, K + 5, generator=g)
    w, s = _random_fp4(N, K, g)
    wb, sb = torch.zeros(N, K // 2 + 3, dtype=torch.uint8), torch.zeros(N, K // 32 + 1, dtype=torch.uint8)
    wb[:, :K // 2], sb[:, :K // 32] = w, s
    x = xb[:, 2:2 + K]                                        # rows K + 5 apart; w's, s's rows padded too
    yb = torch.full((M, N + 2), float("nan"))
    _fp4(lib, x, wb[:, :K // 2], sb[:, :K // 32], yb[:, :N])
    torch.testing.assert_close(yb[:, :N], F.linear(x.double(), dequantize_fp4(w, s).double()).float(), **_tol(K))
    assert yb[:, N:].isnan().all()


def test_every_e2m1_code_and_extreme_scales_through_the_fp4_gemm(lib):
    """each row all 16 codes (x4, shuffled), scales 2^-127 .. 2^125, picked out by an identity-like x: exact"""
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.arange(16).repeat(4)[torch.randperm(64, generator=g)] for _ in range(7)])
    w, s = pack_fp4(codes), torch.tensor([0, 1, 100, 127, 140, 252, 127] * 2, dtype=torch.uint8).view(7, 2)
    want = dequantize_fp4(w, s)
    for M in (2, 5, 64):
        y = torch.empty(M, 7)
        _fp4(lib, torch.eye(64)[:M].contiguous(), w, s, y)
        assert torch.equal(y, want[:, :M].t())


@torch.no_grad()
@pytest.mark.parametrize("T,E,k,H,I", [(1, 4, 2, 64, 32), (7, 5, 2, 96, 64), (33, 8, 3, 160, 96), (40, 3, 3, 32, 32)])
def test_experts_fp4_equal_reference(lib, T, E, k, H, I):
    g = torch.Generator().manual_seed(T + E + H)
    w13, s13 = _random_fp4(E * 2 * I, H, g)
    w2, s2 = _random_fp4(E * H, I, g)
    x = torch.randn(T, H, generator=g)
    ids, wts = _routing(T, E, k, g)
    got = _run_experts(lib, x, w13, w2, s13, s2, ids, wts, gemm.WD_FP4, H, I, E, xp=gemm.fp4_xp(T * k, max(H, I)))
    want = _reference(dequantize_fp4(w13, s13).view(E, 2 * I, H), dequantize_fp4(w2, s2).view(E, H, I), x, ids, wts)
    torch.testing.assert_close(got, want, atol=2e-6 * (H + I) ** 0.5 * want.abs().max().item(), rtol=1e-5)


def _decode64(q, pool, table, lens, block_size, C, scale):
    """the paged MLA decode in float64 over pool [S, D] (float32 values) -> [B, Nh, C] float32"""
    out = []
    for b, L in enumerate(lens):
        ctx = gather_reference(pool.double(), table[b, :-(-L // block_size)].tolist(), L, block_size)   # [L, D]
        out.append((q[b].double() @ ctx.t() * scale).softmax(-1) @ ctx[:, :C])
    return torch.stack(out).float()


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8", "fp4"])
@pytest.mark.parametrize("lens,block_size,heads,C,R", [([1], 4, 1, 16, 8), ([5, 1, 12], 4, 8, 48, 8),
                                                       ([100, 33, 64, 7, 50], 32, 3, 64, 16),
                                                       # every tile: 4 + 1 heads, 3 + 2 and 3 + 1 vectors of 8
                                                       ([17, 40, 9], 16, 5, 80, 5), ([30, 19], 8, 7, 96, 0),
                                                       ([77, 3, 64, 130], 64, 16, 512, 64)])
def test_mla_decode_equals_float64(lib, monkeypatch, kind, lens, block_size, heads, C, R):
    monkeypatch.setattr(layers, "library", lambda: lib)             # the x86-64-v3 build, whatever this CPU has
    monkeypatch.setattr(layers, "tuned_limit", lambda name: 1)      # never torch's path instead
    lib.wd_mla_decode.argtypes, lib.wd_mla_decode.restype = [ctypes.POINTER(layers.MlaDecodeArgs)], ctypes.c_int64
    g = torch.Generator().manual_seed(len(lens) + block_size + C)
    B, M, D = len(lens), max(-(-n // block_size) for n in lens), C + R
    nblocks = B * M + 2
    latents = torch.randn(nblocks * block_size, D, generator=g) * torch.rand(nblocks * block_size, 1, generator=g)
    table = torch.randperm(nblocks, generator=g)[:B * M].view(B, M)
    q = torch.randn(B, heads, D, generator=g)
    layout = {"fp8": Fp8Latent(C, R, torch.bfloat16), "fp4": Fp4Latent(C, R, torch.float32)}.get(kind)
    if layout is not None:
        pool = layout.quantize(latents)
        values = layout.dequantize(pool, torch.float32)
    else:
        pool = latents.to(getattr(torch, kind))
        values = pool.float()
    got = layers.mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), block_size, C, 0.11, max(lens),
                            fp8=layout)
    torch.testing.assert_close(got, _decode64(q, values, table, lens, block_size, C, 0.11), atol=1e-5, rtol=1e-5)
