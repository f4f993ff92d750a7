"""Triton paged MLA decode over an fp4 (e2m1, NVFP4-style) latent cache == the torch paged reference over the
same pool dequantised: the kernel reads the packed rows (nibbles, e4m3 group scales, the float32 token scale,
RoPE part) itself. fp32 and bf16 queries, one and several splits, C 32 to 512; MLA's triton backend on an fp4
cache == its torch backend (TRITON_INTERPRET=1 on CPU: tests/kernels/conftest.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wideep.attention_mla.fp4_cache import Fp4Latent  # noqa: E402
from wideep.attention_mla.paged_decode import paged_decode_reference  # noqa: E402
from wideep.attention_mla.triton_decode import DecodeTiles, mla_decode  # noqa: E402
from tests.kernels.conftest import poisoned  # noqa: E402

TILES = DecodeTiles(block_h=16, block_n=16, num_warps=1, num_stages=1)


def _case(lens, block_size, N, C, R, dtype, device):
    """-> q [B, N, C+R], the packed fp4 pool, the same pool dequantised, block_table, seq_lens, layout."""
    fp4 = Fp4Latent(C, R, dtype)
    nblk = [-(-L // block_size) for L in lens]
    total = sum(nblk) + 2
    perm = torch.randperm(total).tolist()
    table, k = [], 0
    for nb in nblk:
        table.append(perm[k:k + nb] + [0] * (max(nblk) - nb))
        k += nb
    latents = torch.randn(total * block_size, C + R, device=device) * torch.rand(total * block_size, 1, device=device)
    pool = fp4.quantize(latents)
    q = torch.randn(len(lens), N, C + R, device=device).to(dtype)
    return (q, pool, fp4.dequantize(pool, torch.float32), torch.tensor(table, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device), fp4)


@pytest.mark.parametrize("lens,block_size,splits,C", [
    ([1], 4, 1, 32),
    ([37, 8, 64, 3], 8, 3, 48),      # C not a power of two: masked groups
    ([70, 2, 19], 16, None, 512),    # DeepSeek-V3's 32 groups
])
def test_fp4_decode_equals_reference_on_dequantised_pool(lens, block_size, splits, C, device):
    torch.manual_seed(C + len(lens))
    N, R = 20, 16
    q, pool, deq, table, seq_lens, fp4 = _case(lens, block_size, N, C, R, torch.float32, device)
    scale = (C + R) ** -0.5
    got = mla_decode(q, pool, table, seq_lens, block_size, C, scale, max(lens), num_splits=splits, tiles=TILES,
                     out=poisoned(len(lens), N, C, device=device), fp8=fp4)
    ref = paged_decode_reference(q, deq, table, lens, block_size, C, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_fp4_decode_bf16(device):
    torch.manual_seed(3)
    lens, block_size, N, C, R = [40, 17, 1], 8, 16, 32, 16
    q, pool, deq, table, seq_lens, fp4 = _case(lens, block_size, N, C, R, torch.bfloat16, device)
    got = mla_decode(q, pool, table, seq_lens, block_size, C, 0.125, max(lens), num_splits=2, tiles=TILES,
                     out=poisoned(3, N, C, dtype=torch.bfloat16, device=device), fp8=fp4)
    ref = paged_decode_reference(q.float(), deq, table, lens, block_size, C, 0.125)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_fp4_decode_rejects_a_pool_that_does_not_fit(device):
    q, pool, deq, table, seq_lens, fp4 = _case([5], 4, 4, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match=rf"kv_pool must be \[S, {fp4.row_bytes}\]"):
        mla_decode(q, deq, table, seq_lens, 4, 32, 0.1, 5, fp8=fp4)   # a full-precision pool given as fp4
    with pytest.raises(ValueError, match=r"an fp4 cache's kv_pool must be uint8 \(got torch.int8\)"):
        mla_decode(q, pool.view(torch.int8), table, seq_lens, 4, 32, 0.1, 5, fp8=fp4)
    with pytest.raises(ValueError, match="does not fit"):
        mla_decode(q, pool, table, seq_lens, 4, 32, 0.1, 5, fp8=Fp4Latent(16, 32))


def test_mla_triton_backend_on_fp4_cache_equals_torch(device):
    """MLA decoding over an fp4 cache: backend "triton" (the paged kernel reads the packed rows) == backend
    "torch" (gathers and dequantises)."""
    from wideep.attention_mla.kv_cache import LatentKVPool
    from wideep.attention_mla.meta import AttnMeta
    from tests.attention_mla.test_fp4_mla import fp4_mla
    from tests.attention_mla.test_mla import _meta
    m = fp4_mla(20, seed=4).to(device)
    lens, bs = [23, 9, 31], 4
    pre = _meta(lens, bs)
    x = torch.randn(sum(lens) + len(lens), 48, device=device)
    outs = {}
    for backend in ("torch", "triton"):
        m.backend = backend
        kv = LatentKVPool(1, 64, bs, 40, fp8=m.kv_fp8, device=device).pools[0]
        meta = AttnMeta(pre.positions.to(device), pre.slot_mapping.to(device), pre.block_table.to(device),
                        pre.query_lens, pre.ctx_lens, bs)
        m(x[:sum(lens)], meta, kv, *m.rope.cos_sin(meta.positions))
        table = pre.block_table.to(device)
        pos = torch.tensor(lens, device=device)
        slots = table[torch.arange(len(lens), device=device), pos // bs] * bs + pos % bs
        step = AttnMeta(pos, slots, table, [1] * len(lens), [n + 1 for n in lens], bs)
        outs[backend] = m(x[sum(lens):], step, kv, *m.rope.cos_sin(pos))
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-5)
