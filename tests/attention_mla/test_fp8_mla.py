"""The fp8 (e4m3) latent cache: the quantiser's round-trip bound and layout, both MLA forms over the packed
cache (naive == absorbed, decode and chunked prefill == one prefill: every form reads the same cached
latents), the fp8 output close to the full-precision one, DSA over an fp8 latent cache, byte accounting,
and pools of the wrong kind refused."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.fp8_cache import Fp8Latent, check_kv_cache_dtype, latent_layout
from wideep.attention_mla.kv_cache import LatentKVPool
from wideep.attention_mla.meta import AttnMeta
from wideep.attention_mla.mla import MLA
from wideep.attention_mla.sparse_mla import SparseMLA
from tests.attention_mla.test_mla import _meta, _mla


def fp8_mla(q_lora: int | None, seed: int = 0) -> MLA:
    """test_mla's MLA (C 24, R 8, hidden 48) with the same weights, over an fp8 cache."""
    src = _mla(q_lora, seed)
    m = MLA(src.cfg, src.rope, kv_cache_dtype="fp8")
    m.load_state_dict(src.state_dict())
    return m


def _pool(m: MLA, slots: int = 64 * 4) -> torch.Tensor:
    return LatentKVPool(1, slots // 4, 4, 32, fp8=m.kv_fp8).pools[0]


@pytest.mark.parametrize("C,R,dtype", [(512, 64, torch.bfloat16), (32, 8, torch.float32), (30, 6, torch.float16)])
def test_round_trip_bound(C, R, dtype):
    """Each no-RoPE value comes back within half an e4m3 step: |x| / 16 (3 mantissa bits) in the normal
    range, scale * 2^-10 among the subnormals; the group's amax exactly (it maps to 448); RoPE as stored."""
    fp8 = Fp8Latent(C, R, dtype)
    x = torch.randn(9, C + R) * torch.logspace(-3, 3, 9)[:, None]
    x[2] = 0
    y = fp8.dequantize(fp8.quantize(x), torch.float32)
    c, yc = x[:, :C].view(9, fp8.num_groups, -1), y[:, :C].view(9, fp8.num_groups, -1)
    scale = c.abs().amax(-1, keepdim=True) / 448
    assert ((yc - c).abs() <= c.abs() / 16 + scale * 2 ** -10 + 1e-30).all()
    torch.testing.assert_close(yc.abs().amax(-1), c.abs().amax(-1), rtol=1e-6, atol=0)
    assert torch.equal(y[:, C:], x[:, C:].to(dtype).float())
    assert not y[2].any() and torch.isfinite(y).all()


def test_layout_and_bytes_per_token():
    """DeepSeek-V3 (C 512 + R 64, 61 layers): 656 bytes a token a layer in bf16 (512 e4m3 + 4 scales + 64
    bf16) instead of 1152; 784 instead of 2304 in fp32; the no-RoPE part 528 bytes instead of 2048."""
    bf16, fp32 = Fp8Latent(512, 64, torch.bfloat16), Fp8Latent(512, 64, torch.float32)
    assert (bf16.group, bf16.num_groups, bf16.scale_offset, bf16.rope_offset, bf16.row_bytes) == (128, 4, 512, 528, 656)
    assert fp32.row_bytes == 784 and fp32.rope_offset == 528
    assert LatentKVPool.bytes_per_block(61, 64, 576, torch.bfloat16, fp8=bf16) == 61 * 64 * 656
    kv = LatentKVPool(61, 2, 4, 576, torch.bfloat16, fp8=bf16, index_dim=128)
    assert kv.bytes_per_token() == {"latent": 61 * 656, "index_keys": 61 * 128 * 2}
    assert kv.pools[0].dtype == torch.uint8 and kv.index_pools[0].dtype == torch.bfloat16
    assert Fp8Latent(30, 6).scale_offset == 32 and Fp8Latent(30, 6).row_bytes == 60   # parts stay 4-aligned
    assert latent_layout("auto", 512, 64, torch.bfloat16) is None
    assert latent_layout("fp8_e4m3", 512, 64, torch.bfloat16) == bf16


def test_bad_kv_cache_dtype_is_named():
    for bad in ("fp8_e5m2", "int8", None):
        with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of .*got {bad!r}"):
            check_kv_cache_dtype(bad)


@pytest.mark.parametrize("q_lora", [None, 20])
def test_naive_equals_absorbed_on_fp8_cache(q_lora):
    m = fp8_mla(q_lora)
    lens = [7, 1, 13]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), 48)
    outs = {}
    for mode in ("naive", "absorbed"):
        m.mode, pool = mode, _pool(m)
        outs[mode] = m(x, meta, pool, *m.rope.cos_sin(meta.positions))
    torch.testing.assert_close(outs["naive"], outs["absorbed"], atol=1e-5, rtol=1e-5)


def test_fp8_output_close_to_full_precision():
    """The same prefill over an fp8 and a full-precision cache: measured max error ~1.5% of the output's
    scale (this shape, seed); bounded at 5%."""
    m, full = fp8_mla(20, seed=2), _mla(20, seed=2)
    lens = [9, 14]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), 48)
    cos, sin = m.rope.cos_sin(meta.positions)
    got, ref = m(x, meta, _pool(m), cos, sin), full(x, meta, torch.zeros(64 * 4, 32), cos, sin)
    assert not torch.equal(got, ref)
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()


def test_decode_and_chunked_prefill_with_a_cached_prefix_equal_one_prefill():
    """Decode token by token (absorbed) and a prefill in chunks (naive over the cached earlier chunks, as
    on a prefix-cache hit) give the one-prefill output: every form reads the same quantised latents."""
    m = fp8_mla(20, seed=3)
    n, bs = 13, 4
    x = torch.randn(n, 48)
    full_meta = _meta([n], bs)
    full = m(x, full_meta, _pool(m), *m.rope.cos_sin(full_meta.positions))
    table = full_meta.block_table
    for chunks in ([(a, a + 1) for a in range(n)], [(0, 8), (8, 9), (9, 13)]):
        pool, outs = _pool(m), []
        for a, b in chunks:
            pos = torch.arange(a, b)
            slots = torch.tensor([int(table[0, j // bs]) * bs + j % bs for j in range(a, b)])
            outs.append(m(x[a:b], AttnMeta(pos, slots, table, [b - a], [b], bs), pool, *m.rope.cos_sin(pos)))
        torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)


def test_sparse_mla_on_fp8_cache_forms_agree():
    """DSA over an fp8 latent cache (indexer keys in the model dtype): naive == absorbed, and with
    index_topk covering the context it equals plain MLA on the same fp8 cache."""
    from tests.attention_mla.test_dsa import DK, _pair
    src, _ = _pair(topk=5, seed=1)
    sparse = SparseMLA(src.cfg, src.dsa, src.rope, kv_cache_dtype="fp8")
    sparse.load_state_dict(src.state_dict())
    lens = [11, 3, 17, 1]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), 48)
    cos, sin = sparse.rope.cos_sin(meta.positions)
    outs = {}
    for mode in ("naive", "absorbed"):
        sparse.mode = mode
        outs[mode] = sparse(x, meta, _pool(sparse), cos, sin, index_pool=torch.zeros(64 * 4, DK))
    torch.testing.assert_close(outs["naive"], outs["absorbed"], atol=1e-5, rtol=1e-5)
    sparse.dsa = type(src.dsa)(**{**src.dsa.__dict__, "index_topk": 64})
    plain = MLA(src.cfg, src.rope, kv_cache_dtype="fp8")
    plain.load_state_dict({k: v for k, v in src.state_dict().items() if not k.startswith("indexer.")})
    torch.testing.assert_close(sparse(x, meta, _pool(sparse), cos, sin, index_pool=torch.zeros(64 * 4, DK)),
                               plain(x, meta, _pool(plain), cos, sin), atol=1e-5, rtol=1e-5)


def test_pool_of_the_wrong_kind_is_refused():
    m, full = fp8_mla(None), _mla(None)
    meta = _meta([3], block_size=4)
    x = torch.randn(3, 48)
    cos, sin = m.rope.cos_sin(meta.positions)
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8 needs a uint8 \[S, 60\] pool"):
        m(x, meta, torch.zeros(64, 32), cos, sin)
    with pytest.raises(ValueError, match=r"kv_cache_dtype auto needs a floating \[S, 32\] pool"):
        full(x, meta, _pool(m), cos, sin)
