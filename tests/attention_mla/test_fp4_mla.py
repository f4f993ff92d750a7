"""The fp4 (e2m1, NVFP4-style) latent cache: round to nearest even and the packed row against float32
references written here (exact), the layout and bytes per token, the torch paged decode over the fp4 cache
against the same decode over the float32 latents (fp4's tolerance), both MLA forms over the packed cache, and
bad layouts / pools refused."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.config import MLAConfig
from wideep.attention_mla.fp4_cache import E2M1, Fp4Latent, e2m1_codes, e2m1_values
from wideep.attention_mla.fp8_cache import check_kv_cache_dtype, latent_layout
from wideep.attention_mla.kv_cache import LatentKVPool
from wideep.attention_mla.meta import AttnMeta
from wideep.attention_mla.mla import MLA
from wideep.attention_mla.paged_decode import paged_decode_reference
from wideep.attention_mla.rope import RopeConfig, RotaryEmbedding
from tests.attention_mla.test_mla import _meta


def nearest_even_reference(v: float) -> float:
    """The e2m1 value nearest |v| (saturating at 6), ties to the even code, with v's sign; one float at a time."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda k: (abs(E2M1[k] - mag), k % 2))
    return -E2M1[best] if v < 0 and best else E2M1[best]


def quantize_reference(x: torch.Tensor, C: int) -> torch.Tensor:
    """float32 quantise-dequantise of the no-RoPE part [T, C], token by token and group by group."""
    out = torch.zeros(x.shape[0], C)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  every product and quotient in float32
    for t in range(x.shape[0]):
        gs = [x[t, g:g + 16].float().abs().max() / f32(6) for g in range(0, C, 16)]
        tok = max(gs) / f32(448)
        tok = tok if tok > 0 else f32(1)
        for i, g in enumerate(range(0, C, 16)):
            s = (gs[i] / tok).clamp(max=448).to(torch.float8_e4m3fn).float() * tok
            for k in range(16):
                if s > 0:
                    out[t, g + k] = f32(nearest_even_reference(float(x[t, g + k].float() / s))) * s
    return out


def test_e2m1_rounding_is_nearest_even_with_saturation():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = torch.tensor(mids + [-m for m in mids] + list(E2M1) + [-v for v in E2M1]
                        + [0.0, -0.0, 0.2499, 0.2501, 5.0001, 6.5, -7.0, 1e30, float("inf"), -float("inf")])
    vals = torch.cat((vals, torch.randn(3 * 5 * 7) * 3))
    got = e2m1_values(e2m1_codes(vals))
    ref = torch.tensor([nearest_even_reference(float(v)) for v in vals])
    assert torch.equal(got, ref)
    # ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert got[:7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert not (e2m1_codes(torch.tensor([-0.0, -0.1])) & 8).any()   # a value rounding to 0 is +0
    odd = torch.randn(3, 5, 7)
    assert e2m1_codes(odd).shape == (3, 5, 7) and torch.equal(e2m1_values(e2m1_codes(odd)).view(-1),
                                                               e2m1_values(e2m1_codes(odd.view(-1))))


@pytest.mark.parametrize("C,R,dtype", [(16, 0, torch.float32), (48, 5, torch.bfloat16), (512, 64, torch.bfloat16),
                                       (32, 8, torch.float32)])
def test_pack_unpack_exact_against_float32_reference(C, R, dtype):
    torch.manual_seed(C + R)
    fp4 = Fp4Latent(C, R, dtype)
    T = 7
    x = torch.randn(T, C + R) * torch.logspace(-4, 4, T)[:, None]
    x[1] = 0                                     # an all-zero token
    x[2, :C] = -x[2, :C].abs()                   # all negative
    x[3, :16] = 1e-12      # a group far below the token's largest reads back as 0 (alone in its token: exactly)
    x[4, :C] = torch.tensor(E2M1 * (C // 8)) * (1 - 2 * (torch.arange(C) % 3 == 0))   # grid values exactly
    y = fp4.dequantize(fp4.quantize(x), torch.float32)
    assert torch.equal(y[:, :C], quantize_reference(x, C))
    assert torch.equal(y[:, C:], x[:, C:].to(dtype).float())
    assert not y[1].any() and (not y[3, :16].any() if C > 16 else y[3, :16].eq(1e-12).all())
    assert torch.isfinite(y).all()
    assert torch.equal(y[4, :C], x[4, :C])       # amax 6 per group: scale 1, every grid value exact


def test_nibble_order_and_offsets():
    """Byte i holds value 2i in its low nibble, 2i+1 in its high one; scales and token scale where documented."""
    fp4 = Fp4Latent(16, 2)
    x = torch.tensor([[6.0, -0.5, 1.0, 0.0] + [0.0] * 12 + [7.0, 8.0]])
    row = fp4.quantize(x)[0]
    assert (fp4.scale_offset, fp4.token_offset, fp4.rope_offset, fp4.row_bytes) == (8, 12, 16, 24)
    assert row[0].item() == 7 | (9 << 4) and row[1].item() == 2
    assert row[8:9].view(torch.float8_e4m3fn).float().item() == 448.0    # the largest group scale
    assert row[12:16].view(torch.float32).item() == pytest.approx(1 / 448)
    assert row[16:24].view(torch.float32).tolist() == [7.0, 8.0]


def test_layout_and_bytes_per_token():
    """DeepSeek-V3 (C 512 + R 64, 61 layers) in bf16: 256 bytes of e2m1 + 32 e4m3 scales + a float32 token scale
    + 128 bytes of RoPE = 420 a token a layer (25,620 over 61 layers; fp8 656 -> 40,016, bf16 1152 -> 70,272)."""
    bf16, fp32 = Fp4Latent(512, 64, torch.bfloat16), Fp4Latent(512, 64, torch.float32)
    assert (bf16.num_groups, bf16.scale_offset, bf16.token_offset, bf16.rope_offset, bf16.row_bytes) \
        == (32, 256, 288, 292, 420)
    assert fp32.row_bytes == 548
    assert Fp4Latent(48, 5, torch.bfloat16).row_bytes == 24 + 4 + 4 + 12   # 24 + 3 scales -> 28, token, 10 -> 12
    assert LatentKVPool.bytes_per_block(61, 64, 576, torch.bfloat16, fp8=bf16) == 61 * 64 * 420
    kv = LatentKVPool(61, 2, 4, 576, torch.bfloat16, fp8=bf16, index_dim=128)
    assert kv.bytes_per_token() == {"latent": 25620, "index_keys": 61 * 128 * 2}
    assert kv.kv_cache_dtype == "fp4_e2m1" and kv.pools[0].dtype == torch.uint8
    assert latent_layout("fp4", 512, 64, torch.bfloat16) == bf16 == latent_layout("fp4_e2m1", 512, 64, torch.bfloat16)
    assert check_kv_cache_dtype("fp4") == "fp4_e2m1" and check_kv_cache_dtype("fp8") == "fp8_e4m3"


def test_bad_layouts_are_named():
    for C in (24, 8, 0):
        with pytest.raises(ValueError, match=f"kv_cache_dtype fp4 needs kv_lora_rank a positive multiple of 16.*got {C}"):
            Fp4Latent(C, 8)
    fp4 = Fp4Latent(32, 8)
    with pytest.raises(ValueError, match=r"latent must be \[T, 40\]"):
        fp4.quantize(torch.zeros(2, 39))
    with pytest.raises(ValueError, match=r"rows must be uint8 \[\.\.\., 56\]"):
        fp4.dequantize(torch.zeros(2, 56))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'nvfp4'"):
        check_kv_cache_dtype("nvfp4")


def _case(lens, block_size, N, C, R, seed=0):
    """-> q [B, N, C+R], float32 latents [S, C+R], the packed fp4 pool of them, block_table, layout."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // block_size) for L in lens]
    total = sum(nblk) + 2
    perm = torch.randperm(total, generator=g).tolist()
    table, k = [], 0
    for nb in nblk:
        table.append(perm[k:k + nb] + [0] * (max(nblk) - nb))
        k += nb
    fp4 = Fp4Latent(C, R)
    latents = torch.randn(total * block_size, C + R, generator=g)
    latents[:, :C] /= latents[:, :C].pow(2).mean(-1, keepdim=True).sqrt()       # RMS-normed, as kv_a_layernorm
    return torch.randn(len(lens), N, C + R, generator=g), latents, fp4.quantize(latents), torch.tensor(table), fp4


def test_paged_decode_on_fp4_cache_close_to_float32_cache():
    """The torch paged reference over the fp4 cache vs over the float32 latents it came from (C 512, R 64,
    RMS-normed latents): relative RMS error of the output measured 0.105-0.122 over seeds 0-3 (fp8's on the
    same latents 0.030-0.032); bounded at 0.16, above fp8's, and above 0 (the cache is really quantised)."""
    lens, bs, N, C, R = [37, 100, 5], 16, 8, 512, 64
    q, latents, pool, table, fp4 = _case(lens, bs, N, C, R)
    scale = (C + R) ** -0.5
    ref = paged_decode_reference(q, latents, table, lens, bs, C, scale)
    got = paged_decode_reference(q, fp4.dequantize(pool, torch.float32), table, lens, bs, C, scale)
    fp8 = latent_layout("fp8", C, R, torch.float32)
    got8 = paged_decode_reference(q, fp8.dequantize(fp8.quantize(latents)), table, lens, bs, C, scale)
    err, err8 = ((got - ref).norm() / ref.norm()).item(), ((got8 - ref).norm() / ref.norm()).item()
    assert err8 < err <= 0.16, (err, err8)


def fp4_mla(q_lora: int | None, seed: int = 0, kv_cache_dtype: str = "fp4") -> MLA:
    """test_mla's MLA with kv_lora_rank 32 (fp4 groups of 16) instead of 24, weights ~ N(0, 0.2)."""
    torch.manual_seed(seed)
    rope = RopeConfig(dim=8, kind="yarn", factor=4.0, original_max_position=16, mscale=0.9, mscale_all_dim=0.7)
    cfg = MLAConfig(hidden_size=48, num_heads=3, q_lora_rank=q_lora, kv_lora_rank=32, qk_nope_head_dim=12,
                    qk_rope_head_dim=8, v_head_dim=10, rope=rope)
    m = MLA(cfg, RotaryEmbedding(rope), kv_cache_dtype=kv_cache_dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def fp4_pool(m: MLA, blocks: int = 64, bs: int = 4) -> torch.Tensor:
    return LatentKVPool(1, blocks, bs, 40, fp8=m.kv_fp8).pools[0]


@pytest.mark.parametrize("q_lora", [None, 20])
def test_naive_equals_absorbed_on_fp4_cache(q_lora):
    m = fp4_mla(q_lora)
    lens = [7, 1, 13]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), 48)
    outs = {}
    for mode in ("naive", "absorbed"):
        m.mode = mode
        outs[mode] = m(x, meta, fp4_pool(m), *m.rope.cos_sin(meta.positions))
    torch.testing.assert_close(outs["naive"], outs["absorbed"], atol=1e-5, rtol=1e-5)


def test_fp4_output_close_to_full_precision_and_decode_equals_prefill():
    """A prefill over an fp4 cache vs a float32 one (measured max error 12.5% of the output's max at this seed,
    6-9% at seeds 3-5; bounded at 15%); decoding token by token over the fp4 cache gives the one-prefill output."""
    m, full = fp4_mla(20, seed=2), fp4_mla(20, seed=2, kv_cache_dtype="auto")
    n, bs = 13, 4
    meta = _meta([n], bs)
    x = torch.randn(n, 48)
    cos, sin = m.rope.cos_sin(meta.positions)
    got, ref = m(x, meta, fp4_pool(m), cos, sin), full(x, meta, torch.zeros(64 * 4, 40), cos, sin)
    assert 0 < (got - ref).abs().max() <= 0.15 * ref.abs().max()
    pool, outs, table = fp4_pool(m), [], meta.block_table
    for a in range(n):
        pos = torch.arange(a, a + 1)
        slots = torch.tensor([int(table[0, a // bs]) * bs + a % bs])
        outs.append(m(x[a:a + 1], AttnMeta(pos, slots, table, [1], [a + 1], bs), pool, *m.rope.cos_sin(pos)))
    torch.testing.assert_close(torch.cat(outs), got, atol=1e-5, rtol=1e-5)


def test_pool_of_the_wrong_kind_is_refused():
    m = fp4_mla(None)
    meta = _meta([3], block_size=4)
    cos, sin = m.rope.cos_sin(meta.positions)
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp4 needs a uint8 \[S, 56\] pool"):
        m(torch.randn(3, 48), meta, torch.zeros(64, 40), cos, sin)
    fp8 = LatentKVPool(1, 16, 4, 40, fp8=latent_layout("fp8", 32, 8, torch.float32)).pools[0]   # 32 + 4 + 32 = 68
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp4 needs a uint8 \[S, 56\] pool"):
        m(torch.randn(3, 48), meta, fp8, cos, sin)
