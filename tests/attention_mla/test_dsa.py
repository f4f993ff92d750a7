"""DeepSeek Sparse Attention: top-k selection (worked example, ties with the causal limit), indexer
scores against a per-head loop, sparse MLA in both forms against a brute-force reference (dense MLA
through an explicitly built selection), plain MLA exactly when index_topk covers the context,
decode / chunked prefill equal to one prefill, indexer keys in the latent's slots."""
from __future__ import annotations

import pytest
import torch

from wideep.attention_mla.config import DSAConfig, MLAConfig, RopeConfig
from wideep.attention_mla.indexer import select_topk, selection_mask
from wideep.attention_mla.meta import AttnMeta
from wideep.attention_mla.mla import MLA
from wideep.attention_mla.rope import RotaryEmbedding
from wideep.attention_mla.sparse_mla import SparseMLA
from tests.attention_mla.test_mla import _meta

H, C, R, DK = 48, 24, 8, 16


def _pair(topk: int, seed: int = 0) -> tuple[SparseMLA, MLA]:
    """A SparseMLA and a plain MLA with the same MLA weights."""
    torch.manual_seed(seed)
    rope = RopeConfig(dim=R, kind="yarn", factor=4.0, original_max_position=16, mscale=0.9, mscale_all_dim=0.7)
    cfg = MLAConfig(hidden_size=H, num_heads=3, q_lora_rank=20, kv_lora_rank=C, qk_nope_head_dim=12,
                    qk_rope_head_dim=R, v_head_dim=10, rope=rope)
    dsa = DSAConfig(index_n_heads=8, index_head_dim=DK, index_topk=topk, rope_dim=R, q_lora_rank=20)
    rot = RotaryEmbedding(rope)
    sparse, dense = SparseMLA(cfg, dsa, rot), MLA(cfg, rot)
    with torch.no_grad():
        for p in sparse.parameters():
            p.normal_(0, 0.2)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    return sparse, dense


def _pools(slots: int = 64 * 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(slots, C + R), torch.zeros(slots, DK)


def test_select_topk_worked_example():
    scores = torch.tensor([[5., 1., 4., 3., 9.],
                           [5., 1., 4., 3., 9.],
                           [0., 7., 2., 8., 1.]])
    idx, n = select_topk(scores, key_limit=torch.tensor([4, 2, 5]), k=3)
    assert n.tolist() == [3, 2, 3]
    assert idx[0].tolist() == [0, 2, 3]          # position 4 (score 9) is in the future
    assert idx[1, :2].tolist() == [0, 1]         # sees 2 tokens, selects both
    assert idx[2].tolist() == [3, 1, 2]
    mask = selection_mask(idx, n, 5)
    assert mask.tolist() == [[True, False, True, True, False], [True, True, False, False, False],
                             [False, True, True, True, False]]
    idx, n = select_topk(scores[:1], torch.tensor([5]), k=9)   # k above the context: all of it
    assert sorted(idx[0].tolist()) == [0, 1, 2, 3, 4] and n.tolist() == [5]


@torch.no_grad()
def tie_prone(sparse: SparseMLA) -> None:
    """Weight one indexer head only, negatively for every input x >= 0: each token whose q.k <= 0 then scores
    exactly 0, the best score there is, and most queries choose among exact ties."""
    w = sparse.indexer.weights_proj.weight
    w[0] = -w[0].abs()
    w[1:] = 0.0


def test_select_topk_breaks_ties_toward_earlier_positions_whatever_the_row_length():
    """Exact ties are common (a token no head scores above 0 scores exactly 0, -0.0 where a head weight is
    negative): the pick among them must not depend on how long the row is or how far it is padded, or a
    decode step (its context's row) and a prefill of the same context (a longer, masked row) differ."""
    for n in (12, 20, 70, 200, 600):
        scores = torch.zeros(n)
        scores[1::5] = -0.0                      # equal to 0.0, so tied with it too
        scores[3], scores[7] = 2.0, 1.0          # two clear winners
        want = [3, 7] + [j for j in range(n) if j not in (3, 7)][:6]
        for width, limit in ((n, n), (n + 9, n), (2 * n, n)):   # the context alone, padded, masked
            row = torch.full((2, width), 5.0)    # padding scores above everything: only key_limit hides it
            row[:, :n] = scores
            idx, k = select_topk(row, torch.tensor([limit, limit]), k=8)
            assert idx[0].tolist() == want and idx[1].tolist() == want and k.tolist() == [8, 8], (n, width)
    idx, _ = select_topk(torch.tensor([[-1., -3., -1., float("-inf"), -2.]]), torch.tensor([5]), k=4)
    assert idx[0].tolist() == [0, 2, 4, 1]       # negatives order as numbers, -inf last


def test_decode_equals_prefill_under_exact_index_ties():
    """One indexer head weighted, negatively for every token: each token with q.k <= 0 scores exactly the
    best score, 0, so most queries choose among ties. Decoding token by token, in a batch with a longer
    sequence (which pads the decode rows to its context), equals one prefill."""
    sparse, _ = _pair(topk=4, seed=5)
    tie_prone(sparse)
    n, pad, bs = 21, 40, 3
    x = torch.randn(n + n + pad, H).abs()   # x >= 0, as tie_prone needs
    full_meta = _meta([n, n + pad], bs)
    kv, index = _pools()
    full = sparse(x, full_meta, kv, *sparse.rope.cos_sin(full_meta.positions), index_pool=index)[:n]
    table, outs = full_meta.block_table, []
    kv, index = _pools()
    for a in range(n):   # the first sequence's token a; the other's token pad + a (only its length matters)
        pos = torch.tensor([a, pad + a])
        slots = torch.tensor([int(table[b, j // bs]) * bs + j % bs for b, j in enumerate(pos.tolist())])
        meta = AttnMeta(pos, slots, table, [1, 1], [a + 1, pad + a + 1], bs)
        outs.append(sparse(x[[a, n + pad + a]], meta, kv, *sparse.rope.cos_sin(pos), index_pool=index)[:1])
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)


def test_indexer_scores_equal_a_per_head_loop():
    sparse, _ = _pair(4)
    ix = sparse.indexer
    x, q_lat = torch.randn(5, H), torch.randn(5, 20)
    cos, sin = sparse.rope.cos_sin(torch.arange(5))
    q, w = ix.queries(x, q_lat, cos, sin)
    keys = torch.randn(5, 9, DK)
    got = ix.scores(q, w, keys)
    want = torch.zeros(5, 9)
    for t in range(5):
        for h in range(8):
            want[t] += w[t, h] * torch.relu(keys[t] @ q[t, h] * DK ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    shared = ix.scores(q, w, keys[:1])                      # one context shared by all queries
    torch.testing.assert_close(shared[2], ix.scores(q[2:3], w[2:3], keys[:1])[0])


@torch.no_grad()
def _reference(sparse: SparseMLA, dense: MLA, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Per sequence: indexer scores by hand, the top-k of each query's visible tokens by sorting, then
    dense MLA's naive form through that mask."""
    k, out, s = sparse.dsa.index_topk, [], 0
    for n in lens:
        xs = x[s:s + n]
        cos, sin = sparse.rope.cos_sin(torch.arange(n))
        q_nope, q_pe, latent = dense.project(xs, cos, sin)
        q, w = sparse.indexer.queries(xs, sparse.q_latent(xs), cos, sin)
        keys = sparse.indexer.keys(xs, cos, sin)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for t in range(n):
            score = [float(sum(w[t, h] * torch.relu(q[t, h] @ keys[j] * DK ** -0.5) for h in range(8)))
                     for j in range(t + 1)]
            for j in sorted(range(t + 1), key=lambda j: -score[j])[:k]:
                mask[t, j] = True
        out.append(dense.o_proj(dense.attend_naive(q_nope, q_pe, latent, mask).reshape(n, -1)))
        s += n
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["naive", "absorbed", "auto"])
def test_sparse_mla_equals_reference_with_topk_below_the_context(mode):
    sparse, dense = _pair(topk=5, seed=1)
    sparse.mode = mode
    lens = [11, 3, 17, 1]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), H)
    got = sparse(x, meta, *_pools()[:1], *sparse.rope.cos_sin(meta.positions), index_pool=_pools()[1])
    torch.testing.assert_close(got, _reference(sparse, dense, x, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_topk_covering_the_context_is_exactly_plain_mla(mode):
    sparse, dense = _pair(topk=17, seed=2)
    sparse.mode = dense.mode = mode
    lens = [11, 3, 17]
    meta = _meta(lens, block_size=4)
    x = torch.randn(sum(lens), H)
    cos, sin = sparse.rope.cos_sin(meta.positions)
    kv, index = _pools()
    got = sparse(x, meta, kv, cos, sin, index_pool=index)
    assert torch.equal(got, dense(x, meta, _pools()[0], cos, sin))
    # ... and the indexer keys went into the latents' slots, nowhere else
    written = torch.zeros(index.shape[0], dtype=torch.bool)
    written[meta.slot_mapping] = True
    assert (index[written].abs().sum(-1) > 0).all() and not index[~written].any()
    torch.testing.assert_close(index[meta.slot_mapping], sparse.indexer.keys(x, cos, sin))


def test_decode_and_chunked_prefill_equal_one_prefill():
    """Token-by-token decode (absorbed over the selected rows) and a prefill in chunks (naive through
    the mask) both read the index keys and latents of earlier steps from the paged pools."""
    sparse, _ = _pair(topk=4, seed=3)
    n, bs = 19, 4
    x = torch.randn(n, H)
    full_meta = _meta([n], bs)
    kv, index = _pools()
    full = sparse(x, full_meta, kv, *sparse.rope.cos_sin(full_meta.positions), index_pool=index)
    table = full_meta.block_table
    for chunks in ([(a, a + 1) for a in range(n)], [(0, 6), (6, 7), (7, 15), (15, 19)]):
        (kv, index), outs = _pools(), []
        for a, b in chunks:
            pos = torch.arange(a, b)
            slots = torch.tensor([int(table[0, j // bs]) * bs + j % bs for j in range(a, b)])
            meta = AttnMeta(pos, slots, table, [b - a], [b], bs)
            outs.append(sparse(x[a:b], meta, kv, *sparse.rope.cos_sin(pos), index_pool=index))
        torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)


def test_bad_dsa_configs_are_refused():
    with pytest.raises(ValueError, match=r"index_head_dim \(4\) must be at least"):
        DSAConfig(index_n_heads=8, index_head_dim=4, index_topk=8, rope_dim=8, q_lora_rank=16)
    with pytest.raises(ValueError, match="index_topk to be an int >= 1, got 0"):
        DSAConfig(index_n_heads=8, index_head_dim=16, index_topk=0, rope_dim=8, q_lora_rank=16)


def test_missing_or_misshaped_index_pool_is_named():
    sparse, _ = _pair(topk=4)
    meta = _meta([3], 4)
    kv, index = _pools()
    args = (torch.randn(3, H), meta, kv, *sparse.rope.cos_sin(meta.positions))
    with pytest.raises(ValueError, match=r"needs this layer's indexer-key pool \[256, 16\].*got None"):
        sparse(*args)
    with pytest.raises(ValueError, match=r"index_dim=16\).index_pools\), got \(256, 8\)"):
        sparse(*args, index_pool=index[:, :8])
