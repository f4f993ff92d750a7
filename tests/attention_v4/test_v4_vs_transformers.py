"""DeepSeek-V4 on the torch path against transformers 5.24, float32: prompt logprobs within 1e-4, greedy tokens
equal to transformers' generate (its own decode cache of the compressed KV), and chunked prefill + decode through
the streams equal to one whole prefill. Flash-shaped (SWA, SWA, CSA, HCA, CSA) and Pro-shaped (HCA, HCA, CSA,
HCA, CSA) layer orders, hash and scored MoE layers, YaRN on the compress table; window 8, CSA 4:1 with the
indexer keeping 4 entries, HCA 16:1, prompts up to 12 windows long."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.attention_v4.streams import V4Meta
from wideep.engine.model.families import load_model
from tests.oracle import hf_prompt_logprobs
from tests.oracle_v4 import PRO, YARN, make_v4_model

_rng = random.Random(5)
PROMPTS = [[_rng.randrange(2, 200) for _ in range(n)] for n in (3, 17, 40, 97)]
CASES = {"flash": {}, "pro_yarn": dict(layer_types=PRO, rope_parameters=YARN, seed=1)}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    hf = make_v4_model(d, **CASES[request.param])
    return hf, load_model(d, progress=False)


@torch.no_grad()
def _logprobs(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    streams, logits = model.new_streams(), []
    for n in chunks:
        s = streams.num_tokens
        logits.append(model.logits(model(torch.tensor(ids[s:s + n]), V4Meta.build([n], [streams]))))
    assert streams.num_tokens == len(ids)
    lp = torch.cat(logits).log_softmax(-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_prompt_logprobs(models):
    hf, model = models
    for ids in PROMPTS:
        ref = hf_prompt_logprobs(hf, ids)
        diff = (_logprobs(model, ids, [len(ids)]) - ref).abs().max().item()
        assert diff < 1e-4, f"prompt of {len(ids)} tokens: logprobs differ by {diff}"


@pytest.mark.parametrize("tile", [1, 5, 16])
def test_query_tiles_equal_transformers(models, tile, monkeypatch):
    """A chunk's queries attend in tiles (attention_v4/attention.py QUERY_TILE), each over its own key span and
    the entries its last query sees: tiles of 1, 5 (ending mid-window for every ratio) and 16 give transformers'
    logprobs."""
    import wideep.attention_v4.attention as attention
    hf, model = models
    monkeypatch.setattr(attention, "QUERY_TILE", tile)
    for ids in PROMPTS[2:]:
        diff = (_logprobs(model, ids, [len(ids)]) - hf_prompt_logprobs(hf, ids)).abs().max().item()
        assert diff < 1e-4, f"tiles of {tile}, prompt of {len(ids)} tokens: logprobs differ by {diff}"


def test_chunked_prefill_and_decode_equal_one_prefill(models):
    hf, model = models
    ids = PROMPTS[-1]
    whole = _logprobs(model, ids, [len(ids)])
    # chunks that end inside CSA and HCA windows and cross the sliding window, then single tokens
    for chunks in ([13, 30, 1, 1, 20, 32], [1] * 20 + [77], [5, 3, 50, 39]):
        diff = (_logprobs(model, ids, chunks) - whole).abs().max().item()
        assert diff < 1e-5, f"chunks {chunks}: logprobs differ by {diff}"


@torch.no_grad()
def test_greedy_equals_generate(models):
    hf, model = models
    for ids in PROMPTS[1:]:
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        streams = model.new_streams()
        tok = int(model.logits(model(torch.tensor(ids), V4Meta.build([len(ids)], [streams])))[-1].argmax())
        got = [tok]
        for _ in range(15):
            tok = int(model.logits(model(torch.tensor([tok]), V4Meta.build([1], [streams])))[-1].argmax())
            got.append(tok)
        assert got == want, f"prompt of {len(ids)} tokens"


@torch.no_grad()
def test_batched_sequences_equal_alone(models):
    """Several sequences in one step (different lengths and histories) give what each gives alone."""
    hf, model = models
    a, b = model.new_streams(), model.new_streams()
    model(torch.tensor(PROMPTS[3][:50]), V4Meta.build([50], [a]))
    ids = PROMPTS[3][50:60] + PROMPTS[2][:40]
    both = model.logits(model(torch.tensor(ids), V4Meta.build([10, 40], [a, b])))
    a2 = model.new_streams()
    model(torch.tensor(PROMPTS[3][:50]), V4Meta.build([50], [a2]))
    alone = torch.cat([model.logits(model(torch.tensor(PROMPTS[3][50:60]), V4Meta.build([10], [a2]))),
                       model.logits(model(torch.tensor(PROMPTS[2][:40]), V4Meta.build([40], [model.new_streams()])))])
    assert (both - alone).abs().max().item() < 1e-5


def test_the_oracle_exercises_what_it_should(models):
    """The randomised checkpoint is not degenerate: the clamp bites, the indexer drops entries, hashes differ."""
    hf, model = models
    layer = model.layers[0].ffn
    assert layer.gate.tid2eid is not None and len({tuple(r) for r in layer.gate.tid2eid.tolist()}) > 10
    assert model.layers[2].attn.indexer is not None and model.cfg.v4.attention.index_topk * 4 < len(PROMPTS[-1])
    assert any(float(l.attn.attn_sink.detach().abs().max()) > 0.1 for l in model.layers)
    for l in model.layers:   # swiglu_limit 1.0 is reached by some pre-activations
        l.ffn.experts.limit, l.ffn.shared_experts.limit = None, None
    try:
        diff = (_logprobs(model, PROMPTS[-1], [97]) - hf_prompt_logprobs(hf, PROMPTS[-1])).abs().max().item()
    finally:
        for l in model.layers:
            l.ffn.experts.limit = l.ffn.shared_experts.limit = model.cfg.moe.swiglu_limit
    assert diff > 1e-3


@torch.no_grad()
def test_zero_tokens(models):
    """An idle rank's step: no sequences, no tokens, still every layer's operations (and all-to-alls)."""
    hf, model = models
    assert model(torch.zeros(0, dtype=torch.int64), V4Meta.build([], [])).shape == (0, model.cfg.hidden_size)


@torch.no_grad()
def test_hash_layers_load_is_recorded(models):
    """EPLB's recorder counts the hash layers' experts too: exactly tid2eid's picks for the tokens."""
    hf, model = models
    E = model.cfg.moe.n_routed_experts
    counts = [torch.zeros(E, dtype=torch.int64) for _ in model.layers]
    model.routing.record_into(counts)
    try:
        ids = torch.tensor(PROMPTS[2])
        model(ids, V4Meta.build([len(ids)], [model.new_streams()]))
    finally:
        model.routing.record_into(None)
    hashed = model.layers[0].ffn.gate.tid2eid[ids].reshape(-1)
    assert torch.equal(counts[0], torch.bincount(hashed, minlength=E))
    assert all(int(c.sum()) == len(ids) * model.cfg.moe.top_k for c in counts)
