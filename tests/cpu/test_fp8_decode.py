"""The C paged MLA decode over an fp8 latent cache: it reads the packed rows (e4m3 bytes through a lookup
table, group scales, a float32 or bfloat16 RoPE part) and equals the torch reference over the dequantised pool; MLA's
"cpu" backend on an fp8 cache equals its "torch" backend on the same cache, step after step."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.fp8_cache import Fp8Latent
from wideep.attention_mla.paged_decode import paged_decode_reference
from wideep.cpu import layers
from tests.cpu.kernels import CPU


@pytest.mark.parametrize("lens,block_size,heads,C,R", [([1], 4, 1, 16, 8), ([5, 1, 12], 4, 8, 40, 8),
                                                       ([100, 33, 64], 32, 3, 256, 16)])
@pytest.mark.parametrize("rope_dtype", [torch.float32, torch.bfloat16])
def test_fp8_mla_decode_equals_reference_on_dequantised_pool(lens, block_size, heads, C, R, rope_dtype):
    torch.manual_seed(len(lens) + block_size)
    fp8 = Fp8Latent(C, R, rope_dtype)
    B, M = len(lens), max(-(-n // block_size) for n in lens)
    nblocks = B * M + 2
    pool = fp8.quantize(torch.randn(nblocks * block_size, C + R) * torch.rand(nblocks * block_size, 1))
    table = torch.randperm(nblocks)[:B * M].view(B, M)
    q = torch.randn(B, heads, C + R)
    ref = paged_decode_reference(q, fp8.dequantize(pool, torch.float32), table, lens, block_size, C, 0.17)
    got = layers.mla_decode(q, pool, table, torch.tensor(lens, dtype=torch.int32), block_size, C, 0.17, max(lens),
                            fp8=fp8)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fp8_mla_decode_rejects_a_pool_that_does_not_fit():
    fp8 = Fp8Latent(16, 8)
    q, table, lens = torch.randn(1, 2, 24), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"an fp8 pool must be uint8 \[S, 52\]"):
        layers.mla_decode(q, torch.zeros(8, 24), table, lens, 4, 16, 0.1, 3, fp8=fp8)
    half = Fp8Latent(16, 8, torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 RoPE part"):
        layers.mla_decode(q, torch.zeros(8, half.row_bytes, dtype=torch.uint8), table, lens, 4, 16, 0.1, 3, fp8=half)


def test_mla_cpu_backend_on_fp8_cache_equals_torch():
    from wideep.attention_mla.meta import AttnMeta
    from wideep.attention_mla.kv_cache import LatentKVPool
    from tests.attention_mla.test_fp8_mla import fp8_mla
    from tests.attention_mla.test_mla import _meta
    torch.manual_seed(6)
    ref, fast = fp8_mla(20, seed=7), fp8_mla(20, seed=7)
    fast.kernels = CPU           # the table the builder gives a cpu-backend model, then bind its decode
    fast.backend = "cpu"
    lens, bs = [5, 1, 9], 4
    meta = _meta(lens, bs)
    pools = [LatentKVPool(1, 64, bs, 32, fp8=ref.kv_fp8).pools[0] for _ in range(2)]
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
