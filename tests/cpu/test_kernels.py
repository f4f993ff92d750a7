"""The C kernels (cpu/gemm.py, cpu/layers.py) == their torch references on fresh random inputs; bad inputs raise;
the build explains a missing compiler. Skipped where no C compiler can build them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wideep.attention_mla.paged_decode import paged_decode_reference
from wideep.cpu import gemm, layers
from wideep.cpu.build import BuildError, build, unusable, unusable_for
from wideep.cpu.linear import MAX_ROWS, Linear, small_linear
from wideep.moe.experts import Experts
from tests.cpu.kernels import CPU

if unusable() is not None:
    pytest.skip(f"CPU kernels unusable: {unusable()}", allow_module_level=True)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33])
@pytest.mark.parametrize("N,Kd", [(1, 1), (3, 17), (4, 16), (67, 48), (64, 100), (130, 512)])
def test_linear_equals_f_linear(M, N, Kd):
    torch.manual_seed(M * 1000 + N + Kd)
    x, w = torch.randn(M, Kd), torch.randn(N, Kd)
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_linear_strided_rows_and_empty():
    torch.manual_seed(0)
    xb, wb = torch.randn(6, 80), torch.randn(9, 70)
    x, w = xb[:, 3:53], wb[:, 10:60]            # rows 80 / 70 floats apart, 50 features used
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert gemm.linear(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert torch.equal(gemm.linear(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))


def test_bmm_nt_batch_strides_and_out():
    torch.manual_seed(1)
    x = torch.randn(5, 7, 3, 24).transpose(0, 1)[:, :, 1]      # [7, 5, 24], batch stride 24, row stride 72*...
    w = torch.randn(7, 40, 24)
    out = torch.full((5, 7, 40), float("nan")).transpose(0, 1)  # written through a strided view
    gemm.bmm_nt(x, w, out=out)
    torch.testing.assert_close(out, x @ w.transpose(1, 2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("R,E,k,H,I", [(1, 4, 1, 32, 24), (5, 64, 6, 64, 32), (16, 16, 4, 48, 40), (64, 8, 2, 40, 17)])
@torch.no_grad()
def test_experts_equal_reference(R, E, k, H, I):
    torch.manual_seed(R + E)
    ex = Experts(E, H, I, kernels=CPU)
    ex.w13.normal_(0, 0.2)
    ex.w2.normal_(0, 0.2)
    x = torch.randn(R, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(R)])
    ids[torch.rand(R, k) < 0.2] = -1            # slots whose expert lives on another rank
    ids[:, 0] = torch.where(ids[:, 0] == E - 1, 0, ids[:, 0])    # expert E-1: no tokens (or few)
    w = torch.rand(R, k)
    torch.testing.assert_close(gemm.experts(x, ex.w13, ex.w2, ids, w), ex.forward_reference(x, ids, w),
                               atol=1e-5, rtol=1e-5)
    ex.backend = "cpu"
    torch.testing.assert_close(ex(x, ids, w), ex.forward_reference(x, ids, w), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_experts_saturated_silu_and_no_local_expert():
    torch.manual_seed(2)
    ex = Experts(4, 32, 32)
    ex.w13.normal_(0, 3.0)                      # gate values far beyond exp's range: silu saturates
    ex.w2.normal_(0, 0.2)
    x, w = torch.randn(6, 32) * 10, torch.rand(6, 2)
    ids = torch.randint(0, 4, (6, 2))
    ref = ex.forward_reference(x, ids, w)
    torch.testing.assert_close(gemm.experts(x, ex.w13, ex.w2, ids, w), ref, atol=1e-5 * ref.abs().max(), rtol=1e-5)
    none = torch.full((6, 2), -1)
    assert torch.equal(gemm.experts(x, ex.w13, ex.w2, none, w), torch.zeros(6, 32))


@pytest.mark.parametrize("lens,block_size,heads,D,C", [([1], 4, 1, 16, 16), ([5, 1, 12], 4, 8, 40, 32),
                                                        ([100, 33, 64], 32, 3, 48, 40), ([17, 16], 16, 16, 160, 128),
                                                        # every register tile of the output pass and the tails
                                                        ([9, 30], 8, 5, 80, 67), ([7, 40], 16, 4, 40, 32)])
def test_mla_decode_equals_reference(lens, block_size, heads, D, C):
    torch.manual_seed(len(lens) + block_size)
    B, M = len(lens), max(-(-n // block_size) for n in lens)
    nblocks = B * M + 2
    pool = torch.randn(nblocks * block_size, D)
    table = torch.randperm(nblocks)[:B * M].view(B, M)
    q = torch.randn(B, heads, D)
    ref = paged_decode_reference(q, pool, table, lens, block_size, C, 0.17)
    got = layers.mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), block_size, C, 0.17, max(lens))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (2, 3, 130), (0, 16)])
def test_rmsnorm_equals_module(shape):
    from wideep.layers import RMSNorm
    torch.manual_seed(4)
    ref, fast = RMSNorm(shape[-1], 1e-5), RMSNorm(shape[-1], 1e-5, kernels=CPU)
    with torch.no_grad():
        ref.weight.normal_()
        fast.weight.copy_(ref.weight)
    x = torch.randn(*shape) * 3
    torch.testing.assert_close(fast(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layers.rmsnorm(x[..., ::1], ref.weight, 1e-5), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_equals_rotary_embedding(interleave):
    from wideep.attention_mla.config import RopeConfig
    from wideep.attention_mla.rope import RotaryEmbedding
    torch.manual_seed(5)
    rot = RotaryEmbedding(RopeConfig(dim=8, interleave=interleave))
    cos, sin = rot.cos_sin(torch.tensor([0, 3, 17, 2]))
    q = torch.randn(4, 3, 20)[..., 12:]                      # a strided view, as MLA's q_pe is
    k = torch.randn(4, 8)
    torch.testing.assert_close(layers.rope(q, cos, sin, interleave), rot.apply(q, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layers.rope(k, cos, sin, interleave), rot.apply(k, cos, sin), atol=1e-6, rtol=1e-6)


def test_small_linear_and_linear_module():
    torch.manual_seed(3)
    lin = Linear(48, 20, bias=True)
    for rows in (1, 5, MAX_ROWS, MAX_ROWS + 1):             # kernel, and F.linear past MAX_ROWS
        x = torch.randn(rows, 48)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, 48)
    torch.testing.assert_close(small_linear(x3, lin.weight), F.linear(x3, lin.weight), atol=1e-5, rtol=1e-5)
    xb = torch.randn(4, 48, dtype=torch.bfloat16)           # not float32: F.linear
    assert small_linear(xb, lin.weight.bfloat16()).dtype == torch.bfloat16


def test_bad_inputs_raise():
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="same K"):
        gemm.linear(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensor"):
        gemm.linear(x.double(), w.double())
    with pytest.raises(ValueError, match="contiguous last dim"):
        gemm.linear(torch.randn(8, 2).t(), w)
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    with pytest.raises(ValueError, match="local id 5, there are 4 local experts"):
        gemm.experts(x, w13, w2, torch.tensor([[5], [0]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"\[El, 2I, H\]"):
        gemm.experts(x, w13, torch.randn(4, 8, 7), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(ValueError, match="w13 is torch.bfloat16, w2 torch.float32: the kernel takes one weight dtype"):
        gemm.experts(x, w13.bfloat16(), w2, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"must both be \[T=2, k\]"):
        gemm.experts(x, w13, w2, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    pool, q, table = torch.randn(32, 8), torch.randn(2, 2, 8), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"seq_lens in \[0, 3\] \(max_len 3\)"):
        layers.mla_decode(q, pool, table, torch.tensor([0, 3], dtype=torch.int32), 4, 6, 1.0, 3)
    with pytest.raises(ValueError, match=r"seq_lens in \[3, 4\] \(max_len 3\)"):
        layers.mla_decode(q, pool, table, torch.tensor([4, 3], dtype=torch.int32), 4, 6, 1.0, 3)
    with pytest.raises(ValueError, match="need 1 .. 2 blocks of 4"):
        layers.mla_decode(q, pool, table, torch.tensor([9, 3], dtype=torch.int32), 4, 6, 1.0, 9)
    with pytest.raises(ValueError, match=r"must be in \[0, 8\)"):
        layers.mla_decode(q, pool, torch.tensor([[0, 1], [2, 8]]), torch.tensor([5, 5], dtype=torch.int32), 4, 6, 1.0,
                          5)
    with pytest.raises(ValueError, match=r"weight \[N=8\]"):
        layers.rmsnorm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="int64 and seq_lens"):
        layers.mla_decode(q, pool, table.int(), torch.tensor([1, 3], dtype=torch.int32), 4, 6, 1.0, 3)


def test_missing_compiler_is_explained(monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-wideep")
    with pytest.raises(BuildError, match="no C compiler: 'no-such-cc-wideep' is not on PATH"):
        build("probe", "int f(void) { return 1; }")


def test_compile_error_is_explained(monkeypatch, tmp_path):
    monkeypatch.setenv("WIDEEP_CACHE_DIR", str(tmp_path))
    with pytest.raises(BuildError, match="could not build the broken kernels"):
        build("broken", "int f(void) { return undefined_name; }")
    assert list(tmp_path.iterdir()) == []        # no half-written library or stray source left behind


def test_unusable_for_device_and_dtype():
    assert "not the CPU" in unusable_for("meta", torch.float32)
    assert "take float32 or bfloat16" in unusable_for("cpu", torch.float16)
    assert unusable_for("cpu", torch.bfloat16) is None
    assert unusable_for("cpu", torch.float32) is None


@pytest.mark.parametrize("q_lora", [None, 20])
def test_mla_cpu_backend_equals_torch(q_lora):
    """Decode steps of 3 sequences through the paged cache: MLA with backend "cpu" (C decode kernel,
    W_UK^T laid out once, C norms and rope) == backend "torch" (absorbed form in torch)."""
    from wideep.attention_mla.meta import AttnMeta
    from tests.attention_mla.test_mla import _meta, _mla
    torch.manual_seed(6)
    from wideep.attention_mla.mla import MLA
    from wideep.attention_mla.rope import RotaryEmbedding
    ref = _mla(q_lora, seed=7)
    fast = MLA(ref.cfg, RotaryEmbedding(ref.cfg.rope, kernels=CPU), linear=CPU.linear, backend="cpu", kernels=CPU)
    fast.load_state_dict(ref.state_dict())
    lens, bs = [5, 1, 9], 4
    meta = _meta(lens, bs)
    pools = [torch.zeros(64 * bs, 32), torch.zeros(64 * bs, 32)]
    x = torch.randn(sum(lens), 48)
    for m, pool in zip((ref, fast), pools):
        m(x, meta, pool, *m.rope.cos_sin(meta.positions))             # prefill (naive form in both)
    for step in range(3):
        pos = [n + step for n in lens]
        slots = [int(meta.block_table[b, p // bs]) * bs + p % bs for b, p in enumerate(pos)]
        dmeta = AttnMeta(torch.tensor(pos), torch.tensor(slots), meta.block_table, [1, 1, 1], [p + 1 for p in pos], bs)
        xs = torch.randn(3, 48)
        outs = [m(xs, dmeta, pool, *m.rope.cos_sin(dmeta.positions)) for m, pool in zip((ref, fast), pools)]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    w = fast.kv_b_proj.weight
    assert fast._w_uk_t_of == (w.data_ptr(), w._version)                # laid out once, still current
