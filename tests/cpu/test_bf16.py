"""The C kernels with bfloat16 weights (and a bfloat16 latent cache) == float32 torch references on the same,
bfloat16-rounded, values, on odd shapes and strides, on both paths: AVX512-BF16 dot products (activations
rounded to bfloat16, where this CPU has them) and the widening path (activations exact). Each path is
checked against the reference that is exact for it, tightly, and against the float32 one within bfloat16
tolerance; a path that did not take effect would fail its tight check."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wideep.attention_mla.paged_decode import paged_decode_reference
from wideep.cpu import gemm, layers
from wideep.cpu.build import unusable
from wideep.cpu.linear import small_linear
from wideep.moe.experts import Experts
from tests.cpu.kernels import CPU, paged_bf16

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)

BF = torch.bfloat16
PATHS = [pytest.param(True, id="dot", marks=pytest.mark.skipif(not gemm.bf16_dot_supported(),
                                                                  reason="this CPU has no AVX512-BF16")),
         pytest.param("tiles", id="tiles", marks=pytest.mark.skipif(not gemm.amx_supported(),
                                                                     reason="this CPU (or its kernel) gives no AMX tiles")),
         pytest.param(False, id="widen")]


@pytest.fixture(params=PATHS)
def dot(request):
    """Run the test with the dot products on (True; "tiles": with the AMX tiles on too, csrc/gemm_amx.c) or off
    (False); the previous settings restored. Both dot-product paths round the activations alike."""
    before, tiles_before = gemm.bf16_dot(), gemm.amx()
    assert gemm.bf16_dot(bool(request.param)) == bool(request.param)
    assert gemm.amx(request.param == "tiles") == (request.param == "tiles")
    yield request.param
    gemm.bf16_dot(before)
    gemm.amx(tiles_before)


def _ref_x(x: torch.Tensor, dot: bool) -> torch.Tensor:
    """The activations as the path reads them: rounded to bfloat16 by the dot products, exact otherwise."""
    return (x.to(BF) if dot else x).double()   # (dot: True or "tiles")


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 9, 33, 70])
@pytest.mark.parametrize("N,K", [(1, 1), (3, 17), (5, 31), (37, 33), (64, 100), (130, 257), (2051, 1031)])
def test_linear_bf16_weights(dot, M, N, K):   # 2051 x 1031: past ROWS4_MIN (gemm_bf16dp.c) with 1-3 rows too
    torch.manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K), torch.randn(N, K).to(BF)
    got = gemm.linear(x, w)
    assert got.dtype == torch.float32
    exact = (_ref_x(x, dot) @ w.double().t()).float()
    torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-5)
    loose = F.linear(x, w.float())            # the float32 model on the rounded weights
    torch.testing.assert_close(got, loose, atol=0.05 * K ** 0.5 if dot else 1e-4, rtol=1e-2 if dot else 1e-5)


def test_the_two_paths_differ_only_by_the_activations_rounding():
    if not gemm.bf16_dot_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    torch.manual_seed(3)
    x, w = torch.randn(4, 96), torch.randn(8, 96).to(BF)
    before = gemm.bf16_dot()
    try:
        gemm.bf16_dot(True)
        on = gemm.linear(x, w)
        gemm.bf16_dot(False)
        off = gemm.linear(x, w)
    finally:
        gemm.bf16_dot(before)
    assert (on - off).abs().max() > 1e-4       # x was rounded on one path only
    torch.testing.assert_close(on, gemm.linear(x.to(BF).float(), w), atol=1e-5, rtol=1e-5)


def test_linear_bf16_strided_rows_and_bf16_activations(dot):
    torch.manual_seed(1)
    xb, wb = torch.randn(6, 80), torch.randn(9, 70).to(BF)
    x, w = xb[:, 3:53], wb[:, 10:60]           # rows 80 / 70 elements apart, 50 features used
    torch.testing.assert_close(gemm.linear(x, w), (_ref_x(x, dot) @ w.double().t()).float(), atol=1e-4, rtol=1e-5)
    xh = torch.randn(5, 50).to(BF)             # bfloat16 activations: widened exactly
    torch.testing.assert_close(gemm.linear(xh, w), (xh.double() @ w.double().t()).float(), atol=1e-4, rtol=1e-5)
    y = small_linear(xh, w, torch.randn(9))
    assert y.dtype == BF and y.shape == (5, 9)


def test_bmm_nt_bf16_weights_strides_and_bf16_out(dot):
    torch.manual_seed(2)
    x = torch.randn(5, 7, 3, 24).transpose(0, 1)[:, :, 1]       # [7, 5, 24], odd batch and row strides
    w = torch.randn(7, 40, 48).to(BF)[:, :, 5:29]               # [7, 40, 24], rows 48 apart
    exact = (_ref_x(x, dot) @ w.double().transpose(1, 2)).float()
    out = torch.full((5, 7, 40), float("nan")).transpose(0, 1)
    gemm.bmm_nt(x, w, out=out)
    torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-5)
    out16 = torch.full((5, 7, 40), float("nan"), dtype=BF).transpose(0, 1)   # rounded once, written through the view
    gemm.bmm_nt(x, w, out=out16)
    torch.testing.assert_close(out16, exact.to(BF), atol=0, rtol=0)


@pytest.mark.parametrize("R,E,k,H,I", [(1, 4, 1, 32, 24), (5, 64, 6, 64, 32), (16, 16, 4, 48, 40), (64, 8, 2, 40, 17),
                                       (3, 5, 2, 33, 19)])
@torch.no_grad()
def test_experts_bf16_weights(dot, R, E, k, H, I):
    torch.manual_seed(R + E)
    ex = Experts(E, H, I, kernels=CPU)
    ex.w13.normal_(0, 0.2)
    ex.w2.normal_(0, 0.2)
    ex.w13.copy_(ex.w13.to(BF))                # float32 holding the bfloat16 values: the reference's weights
    ex.w2.copy_(ex.w2.to(BF))
    x = torch.randn(R, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(R)])
    ids[torch.rand(R, k) < 0.2] = -1
    w = torch.rand(R, k)
    got = gemm.experts(x, ex.w13.to(BF), ex.w2.to(BF), ids, w)
    ref = ex.forward_reference(x, ids, w)
    tol = 2e-2 if dot else 1e-5
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    got16 = gemm.experts(x.to(BF), ex.w13.to(BF), ex.w2.to(BF), ids, w)   # bfloat16 activations in and out
    assert got16.dtype == BF
    torch.testing.assert_close(got16.float(), ex.forward_reference(x.to(BF).float(), ids, w), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("N", [1, 15, 16, 100])
def test_rmsnorm_bf16_weight_and_activations(N):
    from wideep.layers import RMSNorm
    torch.manual_seed(N)
    x = torch.randn(3, 5, N)
    norm = RMSNorm(N, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(N) + 0.5)
    w16 = norm.weight.detach().to(BF)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w16.double()
    got = layers.rmsnorm(x, w16, 1e-5)
    assert got.dtype == torch.float32        # x's dtype promoted with the weight's, as RMSNorm's
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-5)
    got16 = layers.rmsnorm(x.to(BF), w16, 1e-5)
    assert got16.dtype == BF
    torch.testing.assert_close(got16.float(), norm.to(BF).forward_native(x.to(BF)).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lens,block_size,heads,D,C", [([1], 4, 1, 24, 16), ([5, 1, 12], 4, 8, 40, 32),
                                                       ([100, 33, 64], 32, 3, 72, 64), ([17, 40], 16, 5, 37, 29)])
def test_mla_decode_bf16_pool(dot, lens, block_size, heads, D, C):
    """Read in place: the scores by the bfloat16 GEMM (q rounded to bfloat16 by the dot products), the
    weighted sum of the rows widened exactly, softmax in float32."""
    torch.manual_seed(len(lens) + D)
    pool, table, q = paged_bf16(lens, block_size, heads, D)
    got = layers.mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), block_size, C, 0.17, max(lens))
    exact = paged_decode_reference(_ref_x(q, dot).float(), pool.float(), table, lens, block_size, C, 0.17)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    loose = paged_decode_reference(q, pool.float(), table, lens, block_size, C, 0.17)
    torch.testing.assert_close(got, loose, atol=2e-2 if dot else 1e-5, rtol=2e-2 if dot else 1e-5)


def test_bad_bf16_inputs_raise():
    x, w = torch.randn(2, 8), torch.randn(3, 8).half()
    with pytest.raises(ValueError, match="w must be a float32 or bfloat16 CPU tensor"):
        gemm.linear(x, w)
    with pytest.raises(ValueError, match="kv_pool must be a float32 or bfloat16 CPU tensor"):
        layers.mla_decode(torch.randn(1, 2, 8), torch.zeros(8, 8).half(), torch.zeros(1, 1, dtype=torch.int64),
                          torch.tensor([3], dtype=torch.int32), 4, 6, 1.0, 3)
    with pytest.raises(ValueError, match="rmsnorm: .* must be float32 or bfloat16"):
        layers.rmsnorm(x, torch.ones(8).half(), 1e-6)


def test_the_environment_starts_the_library_on_the_widening_path():
    """WIDEEP_CPU_BF16_DOT=0 (cpu/build.py): the dot products are off from the first call, in a fresh process."""
    import os
    import subprocess
    import sys
    code = "from wideep.cpu import gemm; print(gemm.bf16_dot(), gemm.bf16_dot_supported())"
    env = dict(os.environ, WIDEEP_CPU_BF16_DOT="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(gemm.bf16_dot_supported())]
    env["WIDEEP_CPU_BF16_DOT"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == [str(gemm.bf16_dot_supported())] * 2


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 builds only")
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_a_build_for_a_cpu_without_avx512_bf16(march, monkeypatch, tmp_path):
    """The library built for an older x86-64 (AVX2; AVX-512 without BF16), as a CI machine's -march=native
    would: both paths still compile (the dot products by target attribute) and, run where this CPU has every
    instruction set the build may use (else compiled only: never an instruction the host lacks), compute right."""
    import ctypes
    from wideep.cpu import build
    monkeypatch.setattr(build, "FLAGS", build.flags(march))
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    lib = build.build("wideep_cpu_" + march.replace("-", "_"), build.sources())
    if build.missing_isa(march):
        pytest.skip(f"built for {march}; not run: this CPU lacks {build.missing_isa(march)}")
    lib.wd_bmm_nt.argtypes, lib.wd_bmm_nt.restype = [ctypes.POINTER(gemm.BmmNtArgs)], ctypes.c_int64
    lib.wd_bf16_dot.argtypes, lib.wd_bf16_dot.restype = [ctypes.POINTER(gemm.Bf16DotArgs)], ctypes.c_int64
    torch.manual_seed(4)
    x, w = torch.randn(5, 77), torch.randn(37, 77).to(BF)
    for dot in (True, False):
        on = lib.wd_bf16_dot(gemm.Bf16DotArgs(want=int(dot)))
        assert on == (dot and gemm.bf16_dot_supported())
        y = torch.empty(5, 37)
        lib.wd_bmm_nt(gemm.BmmNtArgs(x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), B=1, ldx=77, ldw=77, ldy=37, M=5,
                                     N=37, K=77, wdt=gemm.WDT[BF]))
        torch.testing.assert_close(y, (_ref_x(x, bool(on)) @ w.double().t()).float(), atol=1e-4, rtol=1e-5)
