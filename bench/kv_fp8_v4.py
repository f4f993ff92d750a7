"""DeepSeek-V4's fp8 KV streams (kv_cache_dtype "fp8", attention_v4/fp8.py) — bench/kv_fp8.py --model v4.

Bytes: per layer of each kind (sliding, CSA, HCA) at the released attention shape (head_dim 512, rope 64, indexer
keys 128, window 128, CSA 4:1, HCA 128:1) in bf16, "auto" vs "fp8", from the pools' own accounting
(attention_v4/paged.py V4Pools.bytes_per_block / bytes_per_slot over blocks of 64 tokens): the bytes per token of
each stream (window: one row per token, of which a sequence keeps the last W' = 127; compressed and indexer keys:
one entry per m tokens, kept for the whole context) and the slot (compressor states: model dtype either way).
Per model (V4-Flash 43 layers, V4-Pro 61, bench/v4_kv.py's orders): the compressed streams' bytes per token and
the bytes a decoding sequence holds whatever its length (slot + window blocks), as engine/model/v4_cache.py
counts them.
Drift: the tiny V4 of launch/tiny/v4.py (tests' make_v4_model, float32, D 32, R 8) served by the engine with
kv_cache_dtype "auto" and "fp8" on `prompts` random prompts of 5-160 tokens in chunks of 19 tokens:
|prompt logprob - auto's| (mean, max) and the teacher-forced greedy choice equal to auto's.

Last line (JSON): {"entry_bytes": {...}, "per_layer": {kind: {kv: {...}}}, "models": {...}, "drift": {...}}
"""
from __future__ import annotations

import random
import statistics
import tempfile

import torch

from wideep.attention_v4.fp8 import v4_codecs
from wideep.attention_v4.paged import V4Pools
from wideep.attention_v4.pool_layout import v4_kv_spec
from bench.v4_kv import BLOCK, MODELS, v4_config

KVS = ("auto", "fp8")


def per_layer(att, dtype) -> dict:
    """kind -> kv -> stream -> bytes per token of one layer, and its slot bytes."""
    elt, out = torch.empty(0, dtype=dtype).element_size(), {}
    for kind in ("sliding", "csa", "hca"):
        g = v4_kv_spec(att, (kind,), BLOCK)
        out[kind] = {}
        for kv in KVS:
            blk = V4Pools.bytes_per_block(att, (kind,), g, elt, v4_codecs(att, kv, dtype))
            out[kind][kv] = {s: blk[s] / g.tokens_per_block(s) for s in g.streams}
            out[kind][kv]["slot"] = V4Pools.bytes_per_slot(att, (kind,), g, elt)
    return out


def model_bytes(cfg, dtype) -> dict:
    """kv -> the whole model's compressed bytes per token and the bytes a decoding sequence holds whatever its
    length (V4StreamCache, pools on the meta device)."""
    from types import SimpleNamespace
    from wideep.engine.model.v4_cache import V4StreamCache
    model = SimpleNamespace(cfg=cfg, dtype=dtype, device="meta")
    g = v4_kv_spec(cfg.v4.attention, cfg.v4.layer_kinds, BLOCK)
    out = {}
    for kv in KVS:
        c = V4StreamCache(model, None, BLOCK, 1, 1, 1, num_blocks=dict.fromkeys(g.streams, 1), kv_cache_dtype=kv)
        out[kv] = {"compressed_per_token": c.bytes_per_token(), "per_sequence_fixed": c.per_seq,
                   "per_block": c.per_block}
    out["compressed_ratio"] = round(out["auto"]["compressed_per_token"] / out["fp8"]["compressed_per_token"], 3)
    out["fixed_ratio"] = round(out["auto"]["per_sequence_fixed"] / out["fp8"]["per_sequence_fixed"], 3)
    return out


def drift(num_prompts: int) -> dict:
    from wideep.engine import LLM, SamplingParams
    from wideep.launch.tiny.v4 import tiny_v4_model
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 200) for _ in range(rng.randint(5, 160))] for _ in range(num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        tiny_v4_model(0).save_pretrained(d)
        for kv in KVS:
            llm = LLM(d, dtype="float32", progress=False, enable_prefix_caching=False, max_num_batched_tokens=19,
                      kv_cache_dtype=kv)
            runs[kv] = [o.prompt_logprobs for o in llm.generate(prompts, sp)]
            llm.shutdown()
    diffs, agree, total = [], 0, 0
    for ref, got, p in zip(runs["auto"], runs["fp8"], prompts):
        for j in range(1, len(p)):
            diffs.append(abs(got[j][p[j]] - ref[j][p[j]]))
            agree, total = agree + (max(got[j], key=got[j].get) == max(ref[j], key=ref[j].get)), total + 1
    return {"mean_abs_logprob_diff": round(statistics.mean(diffs), 4), "max_abs_logprob_diff": round(max(diffs), 4),
            "greedy_agreement": round(agree / total, 4), "tokens": total}


def run(num_prompts: int) -> dict:
    bf16 = torch.bfloat16
    cfgs = {name: v4_config(**kw) for name, kw in MODELS.items()}
    att = cfgs["v4_flash"].v4.attention
    codecs = v4_codecs(att, "fp8", bf16)
    out = {"entry_bytes": {"kv_bf16": 2 * att.head_dim, "kv_fp8": codecs["window"].entry_bytes,
                           "index_key_bf16": 2 * att.index_head_dim, "index_key_fp8": codecs["index_keys"].entry_bytes},
           "per_layer": per_layer(att, bf16),
           "models": {name: model_bytes(cfg, bf16) for name, cfg in cfgs.items()}}
    if num_prompts:
        out["drift"] = drift(num_prompts)
    return out
