"""The C kernels on AMX tiles (csrc/gemm_amx.c, csrc/mla_amx.c) against float64 references on the values the tiles
read (activations and attention weights rounded to bfloat16, products summed in float32), on odd shapes: both loop
forms of the GEMM (skinny up to 512 rows, wide past it), the row and feature tails that go around the tiles, the
routed experts with few and many rows per expert, the paged MLA decode with block sizes that do and do not hold
whole tiles. Each check also asserts that the tiles ran (the library's call counters), so a path that quietly fell
back would fail; and that oneDNN's own bfloat16 GEMM, which configures the same tiles, is still right after ours."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wideep.cpu import gemm, layers
from wideep.cpu.build import unusable
from tests.cpu.kernels import paged_bf16
from wideep.moe.fp8 import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)
if not gemm.amx_supported():
    pytest.skip("this CPU (or its kernel) gives no AMX tiles", allow_module_level=True)

BF = torch.bfloat16


@pytest.fixture(autouse=True)
def tiles():
    """The dot products and the tiles on for each test; the previous settings restored."""
    before = gemm.bf16_dot(), gemm.amx()
    assert gemm.bf16_dot(True) and gemm.amx(True)
    yield
    gemm.bf16_dot(before[0])
    gemm.amx(before[1])


def _ran(kind: str, before: dict[str, int]) -> int:
    return gemm.amx_calls()[kind] - before[kind]


@pytest.mark.parametrize("M", [1, 3, 16, 17, 33, 100, 512, 513, 700])
@pytest.mark.parametrize("N,K", [(16, 32), (37, 100), (130, 257), (48, 1024), (1030, 64)])
def test_linear_on_tiles(M, N, K):
    """y = x @ w^T with x rounded to bfloat16, float32 sums: rows of w past a multiple of 16 and features past a
    multiple of 32 go around the tiles; the wide form (past 512 rows) packs w a group at a time."""
    torch.manual_seed(M * 7 + N + K)
    x, w = torch.randn(M, K), torch.randn(N, K).to(BF)
    before = gemm.amx_calls()
    got = gemm.linear(x, w)
    assert _ran("gemm", before) == 1
    exact = (x.to(BF).double() @ w.double().t()).float()
    torch.testing.assert_close(got, exact, atol=1e-4 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("M,N,K", [(5, 48, 64), (100, 130, 257), (600, 64, 96)])
def test_bf16_activations_read_as_they_are(M, N, K):
    """A bfloat16 x goes to the tiles unconverted (linear, bmm_nt), strided rows included: the same sums as the
    float32 x it rounds to."""
    torch.manual_seed(M + N)
    x = torch.randn(M, K + 3).to(BF)[:, 2:K + 2]
    w = torch.randn(N, K).to(BF)
    before = gemm.amx_calls()
    got = gemm.linear(x, w)
    assert _ran("gemm", before) == 1
    assert torch.equal(got, gemm.linear(x.float(), w))
    torch.testing.assert_close(got, (x.double() @ w.double().t()).float(), atol=1e-4 * K ** 0.5, rtol=1e-5)
    xb, wb = x[None].expand(3, M, K), w[None].expand(3, N, K)
    assert torch.equal(gemm.bmm_nt(xb, wb), got[None].expand(3, M, N))


def test_linear_on_tiles_strided_and_the_dot_products_agree():
    torch.manual_seed(1)
    xb, wb = torch.randn(40, 300), torch.randn(70, 400).to(BF)
    x, w = xb[:, 7:263], wb[:, 3:259]         # rows 300 / 400 elements apart, 256 features used
    on = gemm.linear(x, w)
    gemm.amx(False)
    off = gemm.linear(x, w)
    torch.testing.assert_close(on, off, atol=1e-4, rtol=1e-5)   # the same products, summed in another order
    torch.testing.assert_close(on, (x.to(BF).double() @ w.double().t()).float(), atol=1e-4, rtol=1e-5)


def test_onednn_after_the_tiles():
    """Our kernels release the tiles at the end of every call; oneDNN's bfloat16 GEMM (on the same tiles where it
    uses AMX) configures its own: both stay right when they alternate in one thread."""
    torch.manual_seed(2)
    x, w = torch.randn(300, 256).to(BF), torch.randn(512, 256).to(BF)
    ref = (x.double() @ w.double().t()).float()
    for _ in range(3):
        torch.testing.assert_close(gemm.linear(x, w), ref, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(F.linear(x, w).float(), ref, atol=0.5, rtol=2e-2)


@pytest.mark.parametrize("T,E,k,H,I,limit", [(3, 8, 2, 64, 32, None), (64, 32, 6, 128, 64, None),
                                             (700, 4, 2, 96, 64, None), (40, 6, 3, 100, 40, None),
                                             (50, 4, 2, 64, 96, 0.3), (33, 4, 2, 96, 48, 0.3)])
@torch.no_grad()
def test_experts_on_tiles(T, E, k, H, I, limit):
    """Few rows per expert (decode), many (a prefill chunk: 350 per expert), sizes that are whole tiles (each expert
    in one pass, experts_amx.c) and that are not (H 96 / I 48, 100 / 40: a GEMM per matrix, gemm_amx.c), the
    clamped SwiGLU on both; bfloat16 activations in and out."""
    torch.manual_seed(T + E)
    w13, w2 = (torch.randn(E, 2 * I, H) * 0.2).to(BF), (torch.randn(E, H, I) * 0.2).to(BF)
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[torch.rand(T, k) < 0.1] = -1
    wts = torch.rand(T, k)
    before = gemm.amx_calls()
    got = gemm.experts(x, w13, w2, ids, wts, limit=limit)
    used = len(torch.unique(ids[ids >= 0]))   # one call per expert with rows (whole tiles), else one per matrix
    assert _ran("gemm", before) == (used if H % 32 == 0 and I % 32 == 0 else 2 * used)
    ref = torch.zeros(T, H, dtype=torch.float64)
    xr = x.to(BF).double()
    for e in range(E):
        rows, slots = torch.where(ids == e)
        if rows.numel():
            g, u = (xr[rows] @ w13[e].double().t()).chunk(2, dim=-1)
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            a = (F.silu(g) * u).float().to(BF).double()   # the SwiGLU's output rounded as the second GEMM reads it
            ref.index_add_(0, rows, (a @ w2[e].double().t()) * wts[rows, slots, None].double())
    # (an element of a may round to the other bfloat16 neighbour than the float64 reference's: 1e-2)
    torch.testing.assert_close(got, ref.float(), atol=1e-2, rtol=1e-2)
    got16 = gemm.experts(x.to(BF), w13, w2, ids, wts, limit=limit)   # bfloat16 rows read as they are: the same sums
    assert got16.dtype == BF
    assert torch.equal(got16, got.to(BF))


def _mla_reference(q, pool, table, lens, bs, C, scale):
    """The tiles' arithmetic in float64: q rounded to bfloat16 for the scores, softmax, p = exp(...) rounded to
    bfloat16 for the weighted sum, the 1 / sum of the unrounded p applied last."""
    out = torch.zeros(q.shape[0], q.shape[1], C, dtype=torch.float64)
    for b, L in enumerate(lens):
        slots = torch.tensor([int(table[b, j // bs]) * bs + j % bs for j in range(L)])
        rows = pool[slots].double()                                  # [L, D]
        s = q[b].to(BF).double() @ rows.t()                           # [Nh, L]
        p = torch.exp((s - s.max(-1, keepdim=True).values) * scale)
        out[b] = (p.float().to(BF).double() @ rows[:, :C]) / p.sum(-1, keepdim=True)
    return out.float()


@pytest.mark.parametrize("lens,bs,heads,D,C", [([1], 16, 1, 64, 32), ([15, 16, 17, 33], 16, 8, 96, 64),
                                               ([100, 7, 64], 24, 17, 576, 512), ([40, 3], 5, 3, 64, 32),
                                               ([200, 129], 64, 16, 128, 96)])
def test_mla_decode_on_tiles(lens, bs, heads, D, C):
    """The paged decode over a bfloat16 pool: partial groups of 16 rows, block sizes that hold whole tiles (16,
    64) and that do not (24, 5: through the zero-padded copy), heads past a tile (17)."""
    torch.manual_seed(sum(lens) + D)
    pool, table, q = paged_bf16(lens, bs, heads, D)
    before = gemm.amx_calls()
    got = layers.mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), bs, C, 0.07, max(lens))
    assert _ran("mla", before) == 1
    torch.testing.assert_close(got, _mla_reference(q, pool, table, lens, bs, C, 0.07), atol=1e-4, rtol=1e-4)


def test_mla_decode_off_the_tiles_where_the_widths_do_not_fit():
    """D or C not a multiple of 32: the float32 loops run (no tile call), on the same numbers as before."""
    torch.manual_seed(3)
    pool = torch.randn(32, 40).to(BF)
    table = torch.arange(8).view(1, 8)
    before = gemm.amx_calls()
    layers.mla_decode(torch.randn(1, 2, 40), pool, table, torch.tensor([9], dtype=torch.int32), 4, 32, 0.1, 9)
    assert _ran("mla", before) == 0


def test_the_environment_starts_the_library_off_the_tiles():
    """WIDEEP_CPU_AMX=0 (cpu/build.py): the tiles are off from the first call, in a fresh process."""
    import os
    import subprocess
    import sys
    code = "from wideep.cpu import gemm; print(gemm.amx(), gemm.amx_supported())"
    for env, want in (("0", ["False", "True"]), ("1", ["True", "True"])):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, WIDEEP_CPU_AMX=env),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == want


@pytest.mark.parametrize("M", [4, 5, 16, 17, 33, 100, 256])
@pytest.mark.parametrize("N,K,block", [(16, 32, (16, 32)), (48, 96, (16, 32)), (576, 1024, (128, 128)),
                                       (256, 320, (128, 128)), (80, 224, (32, 96))])
def test_fp8_linear_on_tiles(M, N, K, block):
    """FP8 block-quantised weights (csrc/gemm_fp8_amx.c): each weight widened to bfloat16 exactly, x split into up to
    three bfloat16 parts, each block's sums scaled in float32: within float32-grade error of the dequantised float64
    reference, whatever the model's dtype (a last partial block of K, one tile of rows, blocks of 16 x 32 up)."""
    torch.manual_seed(M * 31 + N + K)
    x = torch.randn(M, K)
    q, s = quantize_fp8_block(torch.randn(N, K) * 0.1, block)
    before = gemm.amx_calls()
    got = gemm.linear_fp8(x, q, s, block)
    assert _ran("gemm", before) == 1
    exact = (x.double() @ dequantize_fp8_block(q, s, block, torch.float64).t()).float()
    torch.testing.assert_close(got, exact, atol=2e-5 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("M", [4, 17, 40])
@pytest.mark.parametrize("parts", ["bf16", "two", "one_element_three"])
def test_fp8_linear_on_tiles_with_fewer_parts(M, parts):
    """x whose values need fewer bfloat16 parts (a bfloat16 model's activations: one; a bfloat16 value plus a small
    bfloat16 remainder: two; one element of a row that needs three among bfloat16 values): the tiles run as few parts
    as make x exactly, with float32-grade sums, and a bfloat16 x gives the sums of the bfloat16 dot products."""
    torch.manual_seed(M)
    N, K, block = 96, 320, (32, 64)
    x = torch.randn(M, K).bfloat16().float()
    if parts == "two":
        x = x + (torch.randn(M, K) * 2.0 ** -10).bfloat16().float()
    elif parts == "one_element_three":
        x[M // 2, K - 1] = 1.0 + 2.0 ** -9 + 2.0 ** -20
    q, s = quantize_fp8_block(torch.randn(N, K) * 0.1, block)
    before = gemm.amx_calls()
    got = gemm.linear_fp8(x, q, s, block)
    assert _ran("gemm", before) == 1
    assert _ran("fp8_parts", before) == {"bf16": 1, "two": 2, "one_element_three": 3}[parts]
    exact = (x.double() @ dequantize_fp8_block(q, s, block, torch.float64).t()).float()
    torch.testing.assert_close(got, exact, atol=2e-5 * K ** 0.5, rtol=1e-5)
    gemm.amx(False)
    torch.testing.assert_close(got, gemm.linear_fp8(x, q, s, block), atol=2e-5 * K ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("M,N,K,block", [(3, 48, 96, (16, 32)), (257, 48, 96, (16, 32)), (8, 40, 96, (16, 32)),
                                         (8, 48, 100, (16, 32)), (8, 48, 96, (8, 32)), (8, 48, 96, (16, 16))])
def test_fp8_shapes_off_the_tiles_run_as_before(M, N, K, block):
    """Too few or too many rows, N not a multiple of 16, K not of 32, a block of fewer than 16 rows or 32 features:
    linear_fp8's vector loops, not the tiles, with the same result."""
    torch.manual_seed(M + N + K)
    x = torch.randn(M, K)
    q, s = quantize_fp8_block(torch.randn(N, K) * 0.1, block)
    before = gemm.amx_calls()
    got = gemm.linear_fp8(x, q, s, block)
    assert _ran("gemm", before) == 0
    torch.testing.assert_close(got, F.linear(x, dequantize_fp8_block(q, s, block)), atol=2e-5 * K ** 0.5, rtol=1e-5)


def test_fp8_every_e4m3_value_on_tiles():
    """Every byte (subnormals; the NaN bytes 0x7f / 0xff read as +-480, as the vector loops read them) through the
    tiles' widening: one-hot rows of x pick out weights, exactly; the weight row holds every code."""
    codes = torch.arange(256, dtype=torch.uint8)
    w = torch.stack([codes.roll(r) for r in range(16)]).view(FP8_DTYPE).contiguous()   # [16, 256]
    s = torch.tensor([[0.75, 3.0]])                                                     # 16 x 128 blocks
    x = torch.eye(256)
    before = gemm.amx_calls()
    got = gemm.linear_fp8(x[:200], w, s, (16, 128))                                    # y[m, n] = W[n, m]
    got = torch.cat((got, gemm.linear_fp8(x[200:], w, s, (16, 128))))
    assert _ran("gemm", before) == 2
    gemm.amx(False)
    assert torch.equal(got, gemm.linear_fp8(x, w, s, (16, 128)))                       # the vector loops' values
    finite = (w.view(torch.uint8) & 0x7F) != 0x7F                                       # [16, 256]
    want = dequantize_fp8_block(w, s, (16, 128))
    assert torch.equal(got.t()[finite], want[finite])
