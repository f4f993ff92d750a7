"""DSA decode in Triton == the torch reference: the paged indexer scores equal Indexer.scores over the
gathered keys (several lengths and block sizes, NI and Dk not powers of two, bf16), -inf past each
length; SparseMLA's Triton decode (scores kernel, top-k, paged MLA decode over the selected slots)
equals its torch decode for contexts below and above index_topk; bad inputs raise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wideep.attention_mla.meta import AttnMeta  # noqa: E402
from wideep.attention_mla.triton_indexer import index_scores_paged  # noqa: E402
from tests.attention_mla.test_dsa import DK, H, _pair, _pools, tie_prone  # noqa: E402
from tests.attention_mla.test_mla import _meta  # noqa: E402
from tests.kernels.test_mla_decode import _case  # noqa: E402


@pytest.mark.parametrize("lens,block_size,NI,Dk,dtype", [
    ([1, 17, 64], 16, 8, 16, torch.float32),
    ([70, 3, 129], 8, 12, 40, torch.float32),       # heads and head dim not powers of two
    ([50, 33], 32, 16, 32, torch.bfloat16),
])
def test_paged_scores_equal_the_reference(lens, block_size, NI, Dk, dtype, device):
    sparse, _ = _pair(topk=4)
    q, pool, table, seq_lens = _case(lens, block_size, NI, Dk, 0, dtype, device)    # q [B, NI, Dk], pool [S, Dk]
    w = torch.randn(len(lens), NI, device=device)
    got = index_scores_paged(q, w, pool, table, seq_lens, block_size, Dk ** -0.5, max(lens), block_n=16)
    for b, L in enumerate(lens):
        pos = torch.arange(L, device=device)
        keys = pool[table[b, pos // block_size].long() * block_size + pos % block_size]       # [L, Dk]
        sparse.indexer.scale = Dk ** -0.5
        ref = sparse.indexer.scores(q[b:b + 1].float(), w[b:b + 1], keys[None].float())[0]
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got[b, :L], ref, rtol=tol, atol=tol)
        assert (got[b, L:] == float("-inf")).all()


@pytest.mark.parametrize("topk", [5, 40])   # below every context, above every context
def test_sparse_mla_triton_decode_equals_torch(topk, device):
    sparse, _ = _pair(topk=topk, seed=4)
    sparse = sparse.to(device)
    lens, bs = [23, 9, 31], 4
    pre = _meta(lens, bs)
    x = torch.randn(sum(lens) + len(lens), H, device=device)
    outs = {}
    for backend in ("torch", "triton"):
        sparse.backend = backend
        kv, index = (p.to(device) for p in _pools())
        meta = AttnMeta(pre.positions.to(device), pre.slot_mapping.to(device), pre.block_table.to(device),
                        pre.query_lens, pre.ctx_lens, bs)
        sparse(x[:sum(lens)], meta, kv, *sparse.rope.cos_sin(meta.positions), index_pool=index)   # the prompts
        table = pre.block_table.to(device)
        pos = torch.tensor(lens, device=device)                                                   # one new token each
        slots = table[torch.arange(len(lens), device=device), pos // bs] * bs + pos % bs
        step = AttnMeta(pos, slots, table, [1] * len(lens), [n + 1 for n in lens], bs)
        outs[backend] = sparse(x[sum(lens):], step, kv, *sparse.rope.cos_sin(pos), index_pool=index)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise(device):
    q, pool, table, lens = _case([5, 3], 4, 8, DK, 0, torch.float32, device)
    w = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="must share one of"):
        index_scores_paged(q.half(), w, pool, table, lens, 4, 1.0, 5)
    with pytest.raises(ValueError, match="w must be a float32"):
        index_scores_paged(q, w.double(), pool, table, lens, 4, 1.0, 5)
    with pytest.raises(ValueError, match="int32"):
        index_scores_paged(q, w, pool, table, lens.long(), 4, 1.0, 5)
    with pytest.raises(ValueError, match="index_pool must be"):
        index_scores_paged(q, w, pool[:, :8], table, lens, 4, 1.0, 5)
    with pytest.raises(ValueError, match="blocks of 4 < max_len 50"):
        index_scores_paged(q, w, pool, table, lens, 4, 1.0, 50)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        index_scores_paged(q, w, pool, table, lens, 4, 1.0, 5, block_n=24)


def test_v32_served_with_triton_attention_matches_torch(tmp_path, monkeypatch, device):
    """A tiny V3.2 (index_topk 4: the 7-token prompt decodes sparsely) with attention_backend triton: the
    scores kernel and the paged decode run at every decode step, tokens and logprobs equal torch's."""
    import wideep.attention_mla.triton_indexer as ti
    from wideep.engine import LLM, SamplingParams
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    from tests.kernels.test_backends_e2e import PROMPTS
    calls = {"scores": 0}
    real = ti.index_scores_paged

    def counted(*a, **kw):
        calls["scores"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(ti, "index_scores_paged", counted)
    d = make_tiny_checkpoint(str(tmp_path), "v32", num_hidden_layers=2, n_routed_experts=8, n_group=4,
                             topk_group=2, num_experts_per_tok=2, vocab_size=200, index_topk=4)
    res = {}
    for backend in ("torch", "triton"):
        llm = LLM(d, dtype="float32", device=device, progress=False, block_size=4, kv_cache_blocks=16,
                  attention_backend=backend)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))
        res[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        llm.shutdown()
    assert calls["scores"] == 2 * 3          # both layers, 3 decode steps (contexts 8..10 > index_topk 4)
    for (toks, lps), (rtoks, rlps) in zip(res["triton"], res["torch"]):
        assert toks == rtoks
        for a, b in zip(lps, rlps):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_sparse_mla_triton_decode_equals_prefill_under_exact_index_ties(device):
    """The Triton decode (its own scores kernel, whose sums may give -0.0 where torch gives 0.0) picks the
    same tokens among exact index-score ties as a torch prefill of the same contexts."""
    sparse, _ = _pair(topk=4, seed=5)
    tie_prone(sparse)
    sparse = sparse.to(device)
    lens, bs = [23, 9, 31, 5, 70], 4   # the longest pads the others' decode rows
    x = torch.randn(sum(lens) + len(lens), H, device=device).abs()   # sequence b's n_b + 1 tokens, in order
    full = _meta([n + 1 for n in lens], bs)
    kv, index = (p.to(device) for p in _pools())
    meta = AttnMeta(*(t.to(device) for t in (full.positions, full.slot_mapping, full.block_table)),
                    full.query_lens, full.ctx_lens, bs)
    ends = torch.tensor(full.ctx_lens).cumsum(0) - 1
    want = sparse(x, meta, kv, *sparse.rope.cos_sin(meta.positions), index_pool=index)[ends.to(device)]
    sparse.backend = "triton"
    kv, index = (p.to(device) for p in _pools())
    table = full.block_table.to(device)
    prompt = torch.ones(x.shape[0], dtype=torch.bool)
    prompt[ends] = False
    meta = AttnMeta(*(t.to(device) for t in (full.positions[prompt], full.slot_mapping[prompt])), table, lens, lens, bs)
    sparse(x[prompt.to(device)], meta, kv, *sparse.rope.cos_sin(meta.positions), index_pool=index)
    pos = torch.tensor(lens, device=device)
    step = AttnMeta(pos, full.slot_mapping[ends].to(device), table, [1] * len(lens), [n + 1 for n in lens], bs)
    got = sparse(x[ends.to(device)], step, kv, *sparse.rope.cos_sin(pos), index_pool=index)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
