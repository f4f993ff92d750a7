"""Triton paged MLA decode == the torch paged reference: several lengths, block sizes, batch sizes,
split counts; a length-1 sequence and one that exactly fills its last block. Blocks are shuffled
(non-contiguous) and the output is NaN-poisoned before every launch."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wideep.attention_mla.paged_decode import paged_decode_reference  # noqa: E402
from wideep.attention_mla.triton_decode import DecodeTiles, choose_splits, mla_decode  # noqa: E402
from tests.kernels.conftest import poisoned  # noqa: E402

TILES = DecodeTiles(block_h=16, block_n=16, num_warps=1, num_stages=1)


def _case(lens, block_size, N, C, R, dtype, device):
    """-> q [B, N, C+R], pool, block_table, seq_lens: each sequence in randomly chosen blocks."""
    nblk = [-(-L // block_size) for L in lens]
    total = sum(nblk) + 2
    perm = torch.randperm(total).tolist()
    width = max(nblk)
    table, k = [], 0
    for nb in nblk:
        table.append(perm[k:k + nb] + [0] * (width - nb))
        k += nb
    pool = torch.randn(total * block_size, C + R, device=device).to(dtype)
    q = torch.randn(len(lens), N, C + R, device=device).to(dtype)
    return (q, pool, torch.tensor(table, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device))


@pytest.mark.parametrize("lens,block_size,splits", [
    ([1], 4, 1),                      # a single latent
    ([16, 5, 1], 16, 2),              # 16 fills its block exactly; a split with no tokens for the short ones
    ([37, 8, 64, 3], 8, 3),           # 8 and 64 fill their last block; 37 and 3 do not
    ([100, 33], 32, 4),
    ([70, 2, 19, 45, 1, 64], 16, None),  # split count from the heuristic
])
def test_decode_fp32_equals_reference(lens, block_size, splits, device):
    N, C, R = 20, 48, 16              # N not a multiple of the head block, C not a power of two
    q, pool, table, seq_lens = _case(lens, block_size, N, C, R, torch.float32, device)
    scale = (C + R) ** -0.5
    out = poisoned(len(lens), N, C, device=device)
    got = mla_decode(q, pool, table, seq_lens, block_size, C, scale, max(lens), num_splits=splits, tiles=TILES,
                     out=out)
    ref = paged_decode_reference(q, pool, table, lens, block_size, C, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype, device):
    lens, block_size, N, C, R = [40, 17, 1], 8, 16, 32, 16
    q, pool, table, seq_lens = _case(lens, block_size, N, C, R, dtype, device)
    got = mla_decode(q, pool, table, seq_lens, block_size, C, 0.125, max(lens), num_splits=2, tiles=TILES,
                     out=poisoned(3, N, C, dtype=dtype, device=device))
    ref = paged_decode_reference(q.float(), pool.float(), table, lens, block_size, C, 0.125)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_split_heuristic():
    t = DecodeTiles(block_h=16, min_split_tokens=256)
    assert choose_splits(1, 16, 100, t) == 1                   # too short to split
    assert choose_splits(1, 128, 4096, t) == 16                # 8 programs -> split up to 264 / 8, capped by length
    assert choose_splits(128, 128, 4096, t) == 1               # 1024 programs already fill the GPU


def test_bad_inputs_raise(device):
    q, pool, table, lens = _case([5, 3], 4, 16, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="share one of"):
        mla_decode(q.to(torch.float16), pool, table, lens, 4, 32, 1.0, 5)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, pool, table, lens.long(), 4, 32, 1.0, 5)
    with pytest.raises(ValueError, match="unit stride"):
        mla_decode(q.transpose(1, 2).contiguous().transpose(1, 2), pool, table, lens, 4, 32, 1.0, 5)
    with pytest.raises(ValueError, match="kv_pool must be"):
        mla_decode(q, pool[:, :40], table, lens, 4, 32, 1.0, 5)
    with pytest.raises(ValueError, match="blocks of 4 < max_seq_len"):
        mla_decode(q, pool, table, lens, 4, 32, 1.0, 50)
    with pytest.raises(ValueError, match=r"out must be"):
        mla_decode(q, pool, table, lens, 4, 32, 1.0, 5, out=torch.empty(2, 16, 48, device=device))
    with pytest.raises(ValueError, match="power of two"):
        DecodeTiles(block_h=24)
