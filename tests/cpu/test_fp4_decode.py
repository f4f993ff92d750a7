"""The C paged MLA decode over an fp4 latent cache (attention_mla/fp4_cache.py): it reads the packed rows
(e2m1 nibbles, e4m3 group scales, the float32 token scale, a float32 or bfloat16 RoPE part) and equals the
torch reference over the same pool dequantised (the same floats: only the summation order differs); MLA's
"cpu" backend on an fp4 cache equals its "torch" backend step after step; bad layouts and pools refused."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.fp4_cache import Fp4Latent
from wideep.attention_mla.paged_decode import paged_decode_reference
from wideep.cpu import layers
from tests.cpu.kernels import CPU


@pytest.mark.parametrize("lens,block_size,heads,C,R", [([1], 4, 1, 16, 8), ([5, 1, 12], 4, 8, 48, 5),
                                                       ([100, 33, 64], 32, 3, 512, 64), ([17, 40], 16, 5, 32, 0)])
@pytest.mark.parametrize("rope_dtype", [torch.float32, torch.bfloat16])
def test_fp4_mla_decode_equals_reference_on_the_same_pool(lens, block_size, heads, C, R, rope_dtype):
    torch.manual_seed(len(lens) + block_size + C)
    fp4 = Fp4Latent(C, R, rope_dtype)
    B, M = len(lens), max(-(-n // block_size) for n in lens)
    nblocks = B * M + 2
    latents = torch.randn(nblocks * block_size, C + R) * torch.logspace(-2, 2, nblocks * block_size)[:, None]
    latents[3] = 0                                                       # an all-zero token
    pool = fp4.quantize(latents)
    table = torch.randperm(nblocks)[:B * M].view(B, M)
    q = torch.randn(B, heads, C + R)
    ref = paged_decode_reference(q, fp4.dequantize(pool, torch.float32), table, lens, block_size, C, 0.07)
    got = layers.mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), block_size, C, 0.07, max(lens),
                            fp8=fp4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fp4_mla_decode_rejects_a_pool_that_does_not_fit():
    fp4 = Fp4Latent(16, 8)
    q, table, lens = torch.randn(1, 2, 24), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"an fp4 pool must be uint8 \[S, 48\]"):
        layers.mla_decode(q, torch.zeros(8, 24), table, lens, 4, 16, 0.1, 3, fp8=fp4)
    with pytest.raises(ValueError, match=r"an fp4 pool must be uint8 \[S, 48\]"):
        layers.mla_decode(q, torch.zeros(8, 52, dtype=torch.uint8), table, lens, 4, 16, 0.1, 3, fp8=fp4)  # fp8's width
    half = Fp4Latent(16, 8, torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 RoPE part"):
        layers.mla_decode(q, torch.zeros(8, half.row_bytes, dtype=torch.uint8), table, lens, 4, 16, 0.1, 3, fp8=half)
    with pytest.raises(ValueError, match=r"block id"):
        layers.mla_decode(q, torch.zeros(8, 48, dtype=torch.uint8), table + 5, lens, 4, 16, 0.1, 3, fp8=fp4)


def test_mla_cpu_backend_on_fp4_cache_equals_torch():
    from wideep.attention_mla.kv_cache import LatentKVPool
    from wideep.attention_mla.meta import AttnMeta
    from tests.attention_mla.test_fp4_mla import fp4_mla
    from tests.attention_mla.test_mla import _meta
    torch.manual_seed(6)
    ref, fast = fp4_mla(20, seed=7), fp4_mla(20, seed=7)
    fast.kernels = CPU           # the table the builder gives a cpu-backend model, then bind its decode
    fast.backend = "cpu"
    lens, bs = [5, 1, 9], 4
    meta = _meta(lens, bs)
    pools = [LatentKVPool(1, 64, bs, 40, fp8=ref.kv_fp8).pools[0] for _ in range(2)]
    x = torch.randn(sum(lens), 48)
    for m, pool in zip((ref, fast), pools):
        m(x, meta, pool, *m.rope.cos_sin(meta.positions))
    for step in range(3):
        pos = [n + step for n in lens]
        slots = [int(meta.block_table[b, p // bs]) * bs + p % bs for b, p in enumerate(pos)]
        dmeta = AttnMeta(torch.tensor(pos), torch.tensor(slots), meta.block_table, [1, 1, 1], [p + 1 for p in pos], bs)
        xs = torch.randn(3, 48)
        outs = [m(xs, dmeta, pool, *m.rope.cos_sin(dmeta.positions)) for m, pool in zip((ref, fast), pools)]
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(pools[0], pools[1])     # both wrote the same packed rows
