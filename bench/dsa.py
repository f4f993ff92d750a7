"""DeepSeek Sparse Attention vs dense MLA: the attention part of one decode step.

B sequences, each at context L, one new token each, at a DeepSeek-V3.2-like head shape (hidden 7168,
q_lora 1536, 512 + 64 latent, qk_nope 128, v 128, indexer 64 heads x 128, index_topk 2048; `--heads`
MLA heads: 128 is V3.2's, which a wideep rank runs whole since attention is data-parallel; 16 is one
TP-8 shard's). Both sides run wideep's torch decode paths over a paged cache (shuffled blocks):
- dense: MLA.attend_absorbed over the whole latent context (what a V3 decode step reads);
- dsa: the indexer's projections of the new token (wq_b, wk + LayerNorm, weights_proj, rope), its key
  written into the indexer-key pool, then SparseMLA.attend_sparse_absorbed: all L index keys scored,
  the top-k chosen, only those k latent rows read and attended.
The projections both share (q/kv LoRA, W_UK/W_UV absorption sits inside both forms, o_proj) are left
out; as in SparseMLA.forward, the indexer's queries are computed only when L > index_topk. Bytes read
per decode token per layer, from the cache: dense L x (C+R); dsa L x Dk (index keys) + min(k, L) x (C+R)
(selected latents); the indexer's weights (read once per step, shared by the batch) are reported apart.
Trials of the two sides alternate; the median is kept. Times are the process's CPU time on `--threads`
threads (default 1): on a shared machine other processes inflate wall time, not CPU time; wall times
are reported too. `--backend triton --device cuda` times the Triton decode paths instead (dense:
MLA.attend_paged; dsa: SparseMLA.attend_paged_sparse), wall time with CUDA synchronisation.

    python bench/dsa.py [--contexts 1024,2048,4096,8192,16384] [--batch 4] [--heads 16] [--trials 7]
                        [--dtype float32|bfloat16] [--backend torch|triton] [--device cpu|cuda]

Last line (JSON): {"dsa_vs_dense_attention_8k": ..., "contexts": [...], "dense_ms": [...], "dsa_ms": [...] (CPU),
"dense_wall_ms": [...], "dsa_wall_ms": [...],
"dsa_vs_dense": [...], "bytes_per_token": {"dense": [...], "dsa": [...]}, "indexer_weight_bytes": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from wideep.attention_mla.config import DSAConfig, MLAConfig, RopeConfig  # noqa: E402
from wideep.attention_mla.meta import AttnMeta  # noqa: E402
from wideep.attention_mla.rope import RotaryEmbedding  # noqa: E402
from wideep.attention_mla.sparse_mla import SparseMLA  # noqa: E402
from bench.results import save  # noqa: E402

SHAPE = dict(hidden=7168, q_lora=1536, kv_lora=512, rope=64, nope=128, v=128, index_heads=64, index_dim=128,
             index_topk=2048, block_size=64)


def build(heads: int, dtype: torch.dtype, device: str) -> SparseMLA:
    s = SHAPE
    rope = RopeConfig(dim=s["rope"], theta=10000.0)
    cfg = MLAConfig(hidden_size=s["hidden"], num_heads=heads, q_lora_rank=s["q_lora"], kv_lora_rank=s["kv_lora"],
                    qk_nope_head_dim=s["nope"], qk_rope_head_dim=s["rope"], v_head_dim=s["v"], rope=rope)
    dsa = DSAConfig(index_n_heads=s["index_heads"], index_head_dim=s["index_dim"], index_topk=s["index_topk"],
                    rope_dim=s["rope"], q_lora_rank=s["q_lora"])
    m = SparseMLA(cfg, dsa, RotaryEmbedding(rope, device=device), dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(device) * 0.02)
        m.indexer.k_norm.weight.fill_(1.0)
        m.indexer.k_norm.bias.zero_()
    return m.eval()


def measure(m: SparseMLA, B: int, L: int, trials: int, dtype: torch.dtype, backend: str) -> dict:
    s, g, dev = SHAPE, torch.Generator().manual_seed(L), m.q_a_proj.weight.device
    D, bs = s["kv_lora"] + s["rope"], s["block_size"]
    nblk = -(-L // bs)
    blocks = torch.randperm(B * nblk, generator=g).view(B, nblk)                    # shuffled, paged
    pos = torch.arange(L)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)
    ctx_slots = (blocks[:, pos // bs] * bs + pos % bs).to(dev)                       # [B, L]
    kv_pool, index_pool = rand(B * nblk * bs, D), rand(B * nblk * bs, s["index_dim"])
    x, q_lat = rand(B, s["hidden"]), rand(B, s["q_lora"])
    q_nope, q_pe = rand(B, m.cfg.num_heads, s["nope"]), rand(B, m.cfg.num_heads, s["rope"])
    positions = torch.full((B,), L - 1, device=dev)
    cos, sin = m.rope.cos_sin(positions, max_position=L - 1)
    limit, new = positions + 1, ctx_slots[:, -1]
    meta = AttnMeta(positions, new, blocks.to(dev), [1] * B, [L] * B, bs)
    seqs = list(range(B))

    def indexer():  # the new token's key into the pool; its queries where a context exceeds index_topk
        index_pool.index_copy_(0, new, m.indexer.keys(x, cos, sin).to(dtype))
        return m.indexer.queries(x, q_lat, cos, sin) if L > s["index_topk"] else (None, None)

    if backend == "torch":
        def dense():
            return m.attend_absorbed(q_nope, q_pe, kv_pool[ctx_slots], limit)

        def dsa():
            return m.attend_sparse_absorbed(q_nope, q_pe, *indexer(), kv_pool, index_pool, ctx_slots, limit)
    else:
        def dense():
            return m.attend_paged(q_nope, q_pe, kv_pool, meta, seqs)

        def dsa():
            return m.attend_paged_sparse(q_nope, q_pe, *indexer(), kv_pool, index_pool, meta, seqs)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    cpu, wall = {"dense": [], "dsa": []}, {"dense": [], "dsa": []}
    with torch.inference_mode():
        dense(), dsa()                                                               # warm-up
        for _ in range(trials):
            for name, fn in (("dense", dense), ("dsa", dsa)):
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                sync()
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - t0)
    el = torch.empty(0, dtype=dtype).element_size()
    k = min(s["index_topk"], L)
    ms = {f"{n}_{kind}": statistics.median(d[n]) * 1e3 for kind, d in (("ms", cpu), ("wall_ms", wall))
          for n in ("dense", "dsa")}
    return dict(ms, dense_bytes=L * D * el, dsa_bytes=(L * s["index_dim"] + k * D) * el)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    m = build(a.heads, dtype, a.device)
    ctxs = [int(c) for c in a.contexts.split(",")]
    rows = []
    for L in ctxs:
        r = measure(m, a.batch, L, a.trials, dtype, a.backend)
        if a.device != "cpu":  # a device's time is the wall time (synchronised), not the host's CPU time
            r["dense_ms"], r["dsa_ms"] = r["dense_wall_ms"], r["dsa_wall_ms"]
        rows.append(r)
        print(f"L={L:6d}: dense {r['dense_ms']:8.2f} ms  dsa {r['dsa_ms']:8.2f} ms  ratio "
              f"{r['dsa_ms'] / r['dense_ms']:.3f}  bytes/token dense {r['dense_bytes']} dsa {r['dsa_bytes']}",
              file=sys.stderr, flush=True)
    ix = m.indexer
    out = {"shape": dict(SHAPE, heads=a.heads, batch=a.batch, dtype=a.dtype, threads=a.threads),
           "backend": a.backend, "device": a.device, "time": "cpu" if a.device == "cpu" else "wall", "contexts": ctxs,
           "dense_ms": [round(r["dense_ms"], 3) for r in rows], "dsa_ms": [round(r["dsa_ms"], 3) for r in rows],
           "dense_wall_ms": [round(r["dense_wall_ms"], 3) for r in rows],
           "dsa_wall_ms": [round(r["dsa_wall_ms"], 3) for r in rows],
           "dsa_vs_dense": [round(r["dsa_ms"] / r["dense_ms"], 3) for r in rows],
           "bytes_per_token": {"dense": [r["dense_bytes"] for r in rows], "dsa": [r["dsa_bytes"] for r in rows]},
           "bytes_ratio": [round(r["dsa_bytes"] / r["dense_bytes"], 3) for r in rows],
           "indexer_weight_bytes": sum(p.numel() * p.element_size() for p in ix.parameters())}
    if 8192 in ctxs:
        out["dsa_vs_dense_attention_8k"] = out["dsa_vs_dense"][ctxs.index(8192)]
    save("dsa", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
