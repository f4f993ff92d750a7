"""DeepSeek-V4's KV streams: bytes per sequence at 8k / 128k / 1M tokens (Flash and Pro shapes, vs DeepSeek-V3.2),
and the decode attention time per step at 8k and 64k (vs V3.2's DSA) — a report, no target.

Bytes: what the engine's pools hold for one decoding sequence (attention_v4/paged.py, as engine/model/v4_cache.py
allocates them and engine/sched/block_manager.py counts them: a slot, the window's live blocks and the compressed
streams' blocks its tokens fill; blocks of 64 tokens: window 64 rows, CSA 16 entries, HCA 1 entry of 128 tokens), for
V4-Flash (43 layers: 2 sliding, then CSA / HCA alternating) and V4-Pro (61 layers, transformers' default order) in bf16;
V3.2 as attention_mla's LatentKVPool allocates it (61 layers, latent 576 + indexer key 128). A run checks the pools: a three-layer model (one sliding, one CSA, one
HCA layer at the released attention shapes, hidden 512) prefills `--measure` tokens in chunks of 1024 into the pools
(the block manager growing and trimming its tables) and into the dense reference: outputs equal, and per kind the
pool bytes the sequence holds beside the bytes of its data.

Time: one decode token at context L through one V4 attention layer of each kind at the Flash shape (hidden 4096,
64 heads of 512, q_lora 1024, 8 groups of 1024, indexer 64 x 128 keeping 512), streams filled with random rows
(the torch reference: keys gathered densely, the indexer scores every compressed entry), projections included;
beside it V3.2's DSA decode core (bench/dsa.py's torch path, 64 heads at hidden 4096, projections excluded).
Median of `--trials`, process CPU time on `--threads` threads.

    python bench/v4_kv.py [--contexts 8192,65536] [--measure 8192] [--trials 3] [--threads 1]

Last line (JSON): {"v4_flash_kv_bytes_128k": ..., "bytes": {...}, "decode_ms": {...}, "measured": {...}, ...}
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from wideep.attention_mla.kv_cache import LatentKVPool  # noqa: E402
from wideep.attention_v4.attention import V4Attention  # noqa: E402
from wideep.attention_v4.compressor import CompressorState  # noqa: E402
from wideep.attention_v4.pool_layout import v4_kv_spec  # noqa: E402
from wideep.attention_v4.streams import LayerStreams, SequenceStreams, V4Meta  # noqa: E402
from bench.results import save  # noqa: E402
from wideep.engine.model.model_config import ModelConfig  # noqa: E402
from wideep.engine.model.v4_cache import V4StreamCache  # noqa: E402

SHAPE = dict(head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, sliding_window=128,
             index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=64, vocab_size=1000)
FLASH = ["sliding_attention"] * 2 + ["compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
                                     for i in range(41)]
PRO = ["heavily_compressed_attention"] * 2 + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                                              for i in range(59)]
MODELS = {"v4_flash": dict(hidden_size=4096, num_attention_heads=64, o_groups=8, layer_types=FLASH),
          "v4_pro": dict(hidden_size=7168, num_attention_heads=128, o_groups=16, layer_types=PRO)}
CONTEXTS = {"8k": 8192, "128k": 131072, "1M": 1 << 20}
BLOCK = 64


def v4_config(**kw) -> ModelConfig:
    raw = dict(SHAPE, architectures=["DeepseekV4ForCausalLM"], num_hidden_layers=len(kw["layer_types"]),
               mlp_layer_types=["moe"] * len(kw["layer_types"]), **kw)
    return ModelConfig.from_dict(raw)


def engine_bytes(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """-> the bytes of the pools the engine allocates for one decoding sequence at each context: its slot, its
    window's blocks and the compressed streams' blocks its tokens fill (the block manager's count), allocated on
    the meta device (shapes and dtypes, no memory)."""
    model = SimpleNamespace(cfg=cfg, dtype=dtype, device="meta")
    g = v4_kv_spec(cfg.v4.attention, cfg.v4.layer_kinds, BLOCK)
    out = {}
    for name, n in CONTEXTS.items():
        sizes = {"window": g.decode_window()} | {s: g.entry_blocks(s, n) for s in g.full}
        out[name] = V4StreamCache(model, None, BLOCK, 1, n, 1, num_blocks=sizes).kv.nbytes()
    kv = V4StreamCache(model, None, BLOCK, 1, 1, 1, num_blocks=dict.fromkeys(g.streams, 1))
    return out | {"per_token": kv.bytes_per_token(), "per_sequence_fixed": kv.per_seq,
                  "per_block": kv.per_block, "rows_per_block": {s: g.rows(s) for s in g.streams}}


def v32_bytes(dtype: torch.dtype) -> dict:
    per_block = LatentKVPool.bytes_per_block(61, BLOCK, 576, dtype, 128, None)
    return {name: per_block * -(-n // BLOCK) for name, n in CONTEXTS.items()} | {"per_token": per_block / BLOCK}


@torch.no_grad()
def measured(n: int) -> dict:
    """Prefill n tokens through one attention layer of each kind (released shapes, hidden 512, 2 heads) into the
    engine's pools: per kind, what the sequence holds of them (its slot + its blocks) beside the bytes of the
    data itself (the dense reference's streams after the same tokens)."""
    from wideep.attention_mla.rope import RotaryEmbedding
    from wideep.attention_v4.paged import PagedSequence, V4Pools
    from wideep.engine.sampling_params import SamplingParams
    from wideep.engine.sched.sequence import Sequence
    from wideep.engine.sched.block_manager import BlockManager
    cfg = v4_config(hidden_size=512, num_attention_heads=2, o_groups=1,
                    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    att, kinds = cfg.v4.attention, cfg.v4.layer_kinds
    rope = {"main": RotaryEmbedding(att.rope_main), "compress": RotaryEmbedding(att.rope_compress)}
    layers = [V4Attention(att, k, rope["main" if k == "sliding" else "compress"]) for k in kinds]
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    geo = v4_kv_spec(att, kinds, BLOCK)
    chunk, same = 1024, True
    sizes = {"window": geo.peak(n, chunk, False)["window"]} | {s: geo.entry_blocks(s, n) for s in geo.full}
    pools = V4Pools(att, kinds, geo, sizes, 1, "cpu", torch.float32)
    blocks = BlockManager(geo, sizes, 1, chunk)
    seq = Sequence("measure", None, [1] * n, SamplingParams(), 1)
    blocks.grow(seq, min(chunk, n))   # (the first chunk's blocks: the views read the tables from here on)
    paged = SequenceStreams(PagedSequence(pools, seq.stream_tables).layers)
    dense = SequenceStreams.empty(att, kinds, "cpu", torch.float32)
    for s in range(0, n, chunk):
        x = torch.randn(min(chunk, n - s), 512, generator=g)
        blocks.grow(seq, x.shape[0])      # every pool, for this chunk
        for st in (paged, dense):
            meta = V4Meta.build([x.shape[0]], [st])
            outs = [layer(x, meta, i) for i, layer in enumerate(layers)]
            st.num_tokens += x.shape[0]
            if st is paged:
                first = outs
            else:
                same &= all(torch.equal(a, b) for a, b in zip(first, outs))
        seq.num_computed += x.shape[0]
        blocks.register_computed(seq)   # the window's old blocks go back
    return {"paged_equals_dense": same,
            **{k: {"pool_bytes_held": paged.layers[i].nbytes(), "data_bytes": dense.layers[i].nbytes()}
               for i, k in enumerate(kinds)}}


def _fill(att, kind: str, L: int, g) -> LayerStreams:
    """A sequence's streams at context L - 1, random rows (the decode token is the L-th)."""
    st = LayerStreams.empty(att, kind, "cpu", torch.float32)
    st.window = torch.randn(att.sliding_window - 1, att.head_dim, generator=g)
    m = att.ratio(kind)
    if m:
        n = (L - 1) // m
        st.compressed = torch.randn(n, att.head_dim, generator=g)
        width = 2 * att.head_dim if kind == "csa" else att.head_dim
        r = (L - 1) - n * m
        st.compressor = CompressorState(torch.randn(r, width, generator=g), torch.randn(r, width, generator=g),
                                        entries=n)
        if kind == "csa":
            st.compressor.prev_kv = torch.randn(m, att.head_dim, generator=g)
            st.compressor.prev_gate = torch.randn(m, att.head_dim, generator=g)
            st.index_keys = torch.randn(n, att.index_head_dim, generator=g)
            st.index_compressor = CompressorState(torch.randn(r, 2 * att.index_head_dim, generator=g),
                                                  torch.randn(r, 2 * att.index_head_dim, generator=g), entries=n,
                                                  prev_kv=torch.randn(m, att.index_head_dim, generator=g),
                                                  prev_gate=torch.randn(m, att.index_head_dim, generator=g))
    return st


@torch.no_grad()
def decode_ms(contexts: list[int], trials: int) -> dict:
    from wideep.attention_mla.rope import RotaryEmbedding
    cfg = v4_config(**dict(MODELS["v4_flash"], layer_types=["sliding_attention", "compressed_sparse_attention",
                                                             "heavily_compressed_attention"]))
    att, g = cfg.v4.attention, torch.Generator().manual_seed(1)
    out: dict = {}
    for kind in ("sliding", "csa", "hca"):
        layer = V4Attention(att, kind, RotaryEmbedding(att.rope(kind)))
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        times = []
        for L in contexts:
            x = torch.randn(1, att.hidden_size, generator=g)
            ts = []
            for _ in range(trials + 1):   # the first is a warm-up
                seq = SequenceStreams([_fill(att, kind, L, g)], num_tokens=L - 1)
                meta = V4Meta.build([1], [seq])
                c0 = time.process_time()
                layer(x, meta, 0)
                ts.append(time.process_time() - c0)
            times.append(round(statistics.median(ts[1:]) * 1e3, 3))
        out[kind] = times
    import bench.dsa as dsa
    dsa.SHAPE = dict(dsa.SHAPE, hidden=att.hidden_size)
    m = dsa.build(64, torch.float32, "cpu")
    out["v32_dsa_core"] = [round(dsa.measure(m, 1, L, trials, torch.float32, "torch")["dsa_ms"], 3) for L in contexts]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,65536")
    ap.add_argument("--measure", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ctxs = [int(c) for c in a.contexts.split(",")]
    bf16 = torch.bfloat16
    by = {name: engine_bytes(v4_config(**kw), bf16) for name, kw in MODELS.items()}
    by["v32"] = v32_bytes(bf16)
    for name, b in by.items():
        print(f"{name:9s} " + "  ".join(f"{c}: {b[c] / 2**20:9.1f} MiB" for c in CONTEXTS), file=sys.stderr, flush=True)
    meas = measured(a.measure)
    print(f"measured at {a.measure}: {meas}", file=sys.stderr, flush=True)
    dec = decode_ms(ctxs, a.trials)
    print(f"decode ms at {ctxs}: {dec}", file=sys.stderr, flush=True)
    out = {"v4_flash_kv_bytes_128k": by["v4_flash"]["128k"], "v4_pro_kv_bytes_128k": by["v4_pro"]["128k"],
           "v32_kv_bytes_128k": by["v32"]["128k"], "bytes": by, "dtype": "bfloat16", "block_size": BLOCK,
           "measured": {"tokens": a.measure, **meas},
           "decode_contexts": ctxs, "decode_ms": dec, "threads": a.threads, "time": "cpu"}
    save("v4_kv", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
