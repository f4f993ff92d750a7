"""A tiny DeepSeek-V4 at 64k tokens of context on one CPU rank: the prompt (repeated random blocks, 65,520 tokens)
goes through the engine's chunked prefill (chunks of 4,093: they end mid-window for every ratio) and decode on
the paged streams, and gives what one whole prefill on the dense reference streams gives (greedy tokens equal,
logprobs within 1e-4). While the sequence holds 64k tokens, what the block manager counts for it is what its
pools' rows really hold, and within one block per stream of what the dense reference holds."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from wideep.attention_v4.streams import V4Meta, growing_bytes
from wideep.engine import LLM, SamplingParams
from wideep.engine.model.families import load_model
from tests.oracle_v4 import make_v4_model

CONTEXT = 65536 - 16
NEW = 6


def _prompt() -> list[int]:
    rng = random.Random(3)
    blocks = [[rng.randrange(2, 200) for _ in range(256)] for _ in range(8)]
    ids: list[int] = []
    while len(ids) < CONTEXT:
        ids += blocks[rng.randrange(len(blocks))]
    return ids[:CONTEXT]


@torch.no_grad()
def _dense_greedy(d: str, ids: list[int], n: int):
    """One prefill of every token, then n - 1 single-token decodes, on the dense reference streams ->
    (tokens, their logprobs)."""
    model = load_model(d, progress=False)
    streams, tokens, lps, x = model.new_streams(), [], [], ids
    for _ in range(n):
        lp = model.logits(model(torch.tensor(x), V4Meta.build([len(x)], [streams])))[-1].float().log_softmax(-1)
        tokens.append(int(lp.argmax()))
        lps.append(float(lp[tokens[-1]]))
        x = tokens[-1:]
    return tokens, lps


@pytest.mark.slow
def test_64k_context_chunked_and_paged_equals_one_dense_prefill(tmp_path):
    d = str(tmp_path)
    make_v4_model(d, max_position_embeddings=CONTEXT + 64)
    ids = _prompt()
    llm = LLM(d, dtype="float32", progress=False, enable_prefix_caching=False, max_num_batched_tokens=4093,
              max_model_len=CONTEXT + 64, max_num_seqs=2)
    eng, core = llm.engine, llm.engine.core
    eng.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0))
    held, out = None, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o.outputs[0]
        seq = next(iter(core.scheduler.running), None)
        if held is None and seq is not None and seq.num_computed >= CONTEXT:
            counted = core.kv.per_slot + sum(len(b) * core.kv.per_block[s] for s, b in seq.stream_tables.held().items())
            held = (counted, core.kv.nbytes(), seq.num_computed)
    assert out is not None and held is not None
    tokens, lps = _dense_greedy(d, ids, NEW)
    assert out.token_ids == tokens
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    got = [g.logprob if hasattr(g, "logprob") else g for g in got]
    assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, (got, lps)
    counted, real, n = held
    assert counted == real, "the block manager's count of the sequence's blocks is what its pools' rows hold"
    kv, att, kinds = core.kv, core.model.cfg.v4.attention, core.model.cfg.v4.layer_kinds
    for k in ("csa", "hca"):   # each compressed stream: the entries n tokens close, up to one part-filled block
        data = sum(growing_bytes(att, x, n, 4) for x in kinds if x == k)
        blocks = kv.spec.entry_blocks(k, n) * kv.per_block[k]
        assert data <= blocks < data + kv.per_block[k], (k, n, data, blocks)
    assert real < 24 << 20, f"64k tokens of the tiny V4 hold {real} bytes"
    assert all(a.num_free == a.num_blocks for a in core.blocks.allocators.values())
    llm.shutdown()
