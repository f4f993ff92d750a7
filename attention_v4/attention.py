"""DeepSeek-V4 attention: one core for sliding-window, CSA and HCA layers (attention_v4/config.py).

Legend: T tokens of the step, H hidden, N heads, D head_dim, R rope dim, Q q_lora_rank, G o_groups,
Lo o_lora_rank, W sliding_window, S compressed entries of a sequence.

    q_lat = q_norm(wq_a x)                       [T, Q]   (also the indexer's input)
    q     = rope(rmsnorm_per_head(wq_b q_lat))   [T, N, D]  (unweighted norm; rope on the trailing R channels)
    kv    = rope(norm(wkv x))                    [T, D]   one head, used as both K and V
    keys  = the sequence's last W raw kv (window) ++ its compressed entries (CSA: only the indexer's top-k)
    o     = softmax([q.keys * D^-1/2, sink_h]) without the sink column @ keys        [T, N, D]
    o     = rope^-1(o)   (the rope slice of V carried rotation; undo it at the query's position)
    out   = wo_b( per group g: wo_a_g o_g )      groups of N/G heads -> Lo each -> H

Sliding layers rotate with the main table, CSA/HCA layers (their compressed entries and indexer too) with
the compress table. This is the torch reference: one sequence at a time; the window (and HCA's entries) as one
key set shared by the chunk's queries with a mask, CSA's entries gathered per query (the indexer's top-k).
"""
from __future__ import annotations

import torch
from torch import nn

from wideep.attention_mla.rope import RotaryEmbedding
from wideep.layers import NATIVE, Kernels, RMSNorm
from wideep.moe.fp8_linear import Fp8Linear

from . import decode
from .compressor import Compressor, apply_rope_tail
from .config import V4AttentionConfig
from .indexer import Indexer
from .streams import LayerStreams, V4Meta

QUERY_TILE = 128   # queries of one sequence scored at once (bounds a long chunk's score tensors)


def unweighted_rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Attention(nn.Module):
    """Parameters as DeepSeek's checkpoints name them: wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink,
    compressor (CSA/HCA), indexer (CSA). batched_decode: a decode step's sequences run as one batch
    (attention_v4/decode.py) instead of one at a time (the reference, _sequence); the model's builder sets it."""

    batched_decode = False

    def __init__(self, cfg: V4AttentionConfig, kind: str, rope: RotaryEmbedding, device=None, dtype=None,
                 linear=nn.Linear, kernels: Kernels = NATIVE, side_linear=None):
        """linear: the projections' class (nn.Linear, a backend's, or Fp8Linear.factory: layers/kernels.py; DeepSeek
        stores wq_a, wq_b, wkv, wo_a, wo_b in FP8); side_linear: the compressor's and indexer's (stored in bf16;
        default `linear`); kernels: the backend's table for the norms."""
        super().__init__()
        self.cfg, self.kind, self.rope = cfg, kind, rope
        self.matmul = kernels.matmul   # wo_a's groups one at a time on it (a decode step's rows: the C GEMM)
        H, N, D, Q, G = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups
        kw = dict(bias=False, device=device, dtype=dtype)
        norm = dict(device=device, dtype=dtype, kernels=kernels)
        self.wq_a = linear(H, Q, **kw)
        self.q_norm = RMSNorm(Q, cfg.rms_norm_eps, **norm)
        self.wq_b = linear(Q, N * D, **kw)
        self.wkv = linear(H, D, **kw)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, **norm)
        self.wo_a = linear(N * D // G, G * cfg.o_lora_rank, **kw)   # G blocks [Lo, N*D/G], stacked
        self.wo_b = linear(G * cfg.o_lora_rank, H, **kw)
        self.attn_sink = nn.Parameter(torch.empty(N, device=device, dtype=torch.float32))
        ratio = cfg.ratio(kind)
        side = side_linear or linear
        self.compressor = (Compressor(H, D, ratio, kind == "csa", cfg.rms_norm_eps, device=device, dtype=dtype,
                                      linear=side, kernels=kernels) if ratio else None)
        self.indexer = (Indexer(H, Q, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, ratio, cfg.rms_norm_eps,
                                device=device, dtype=dtype, linear=side, kernels=kernels) if kind == "csa" else None)

    def forward(self, x: torch.Tensor, meta: V4Meta, layer: int) -> torch.Tensor:
        """x [T, H] (the step's tokens, sequences one after another) -> [T, H]; each sequence's streams of
        this layer (meta.streams[i].layers[layer]) take its new tokens."""
        cfg = self.cfg
        T, N, D = x.shape[0], cfg.num_heads, cfg.head_dim
        max_pos = max(meta.ctx_lens) - 1 if meta.lens else 0
        cos, sin = self.rope.cos_sin(meta.positions, max_position=max_pos)     # [T, R/2]
        q_lat = self.q_norm(self.wq_a(x))                                       # [T, Q]
        q = apply_rope_tail(unweighted_rmsnorm(self.wq_b(q_lat).view(T, N, D), cfg.rms_norm_eps), cos, sin, self.rope)
        kv = apply_rope_tail(self.norm(self.wkv(x)), cos, sin, self.rope)      # [T, D]
        if self.batched_decode and decode.batchable(meta, layer):
            out = decode.attend(self, x, q_lat, q, kv, meta, layer, cos, sin)
        else:
            out = torch.empty_like(q)
            for start, n, p0, seq in zip(meta.starts, meta.lens, meta.first, meta.streams):
                s = slice(start, start + n)
                out[s] = self._sequence(x[s], q_lat[s], q[s], kv[s], meta.positions[s], p0, cos[s], sin[s],
                                        seq.layers[layer])
        out = apply_rope_tail(out, cos, -sin, self.rope)                        # undo V's rotation
        G = cfg.o_groups
        return self.wo_b(self._wo_a(out.reshape(T, G, N * D // G)))

    def _wo_a(self, grouped: torch.Tensor) -> torch.Tensor:
        """grouped [T, G, N*D/G] -> [T, G*Lo]: group g through wo_a's rows g*Lo .. (g+1)*Lo (its weight, or as fp8
        on the fp8 kernel when the blocks do not straddle groups)."""
        cfg, (T, G, _) = self.cfg, grouped.shape
        Lo, wo = cfg.o_lora_rank, self.wo_a
        if isinstance(wo, Fp8Linear):
            br = wo.block[0]
            if wo.kernel is not None and Lo % br == 0:
                s = Lo // br
                return torch.cat([wo.kernel(grouped[:, g], wo.weight[g * Lo:(g + 1) * Lo],
                                            wo.weight_scale_inv[g * s:(g + 1) * s], wo.block) for g in range(G)], -1)
            w = wo.dequantized(grouped.dtype).view(G, Lo, -1)
        else:
            w = wo.weight.view(G, Lo, -1)                                       # [G, Lo, N*D/G]
        if self.matmul is not None:
            return torch.cat([self.matmul(grouped[:, g], w[g]) for g in range(G)], dim=-1)   # [T, G*Lo]
        low = torch.bmm(grouped.transpose(0, 1), w.transpose(1, 2))            # [G, T, Lo]
        return low.transpose(0, 1).reshape(T, G * Lo)

    def _sequence(self, x, q_lat, q, kv, positions, p0: int, cos, sin, st: LayerStreams) -> torch.Tensor:
        """One sequence's T new tokens at positions p0.. ([T]): q [T, N, D], kv [T, D] -> o [T, N, D] (still
        rotated). The streams take the whole chunk first; the queries then attend in tiles of QUERY_TILE, each
        over the key span it can see (its window rows, the entries closed by its last query), so a long chunk
        never builds a [T, T] or [T, S] score for all of its queries at once."""
        cfg = self.cfg
        T = x.shape[0]
        window = st.window_rows(p0)
        w0 = window.shape[0]
        # (write_window gives back the chunk's rows as stored: with an fp8 window they are read quantised too, as a
        # later chunk reads them, so chunking changes nothing)
        keys = torch.cat([window, st.write_window(kv, p0)])                     # [w0 + T, D]
        compressed = index_keys = None
        if self.compressor is not None:
            state = st.load_state("compressor", p0)
            compressed = st.append_entries("compressed", self.compressor(x, state, self.rope), p0)   # [S, D]
            st.store_state("compressor", state, p0 + T)
            if self.indexer is not None:
                state = st.load_state("index_compressor", p0)
                index_keys = st.append_entries("index_keys", self.indexer.compressor(x, state, self.rope), p0)
                st.store_state("index_compressor", state, p0 + T)
        out = torch.empty_like(q)
        for t0 in range(0, T, QUERY_TILE):
            t1 = min(T, t0 + QUERY_TILE)
            out[t0:t1] = self._tile(x[t0:t1], q_lat[t0:t1], q[t0:t1], keys, positions[t0:t1], p0 - w0, t0 + w0,
                                    compressed, index_keys, cos[t0:t1], sin[t0:t1])
        return out

    def _tile(self, x, q_lat, q, keys, positions, key0: int, row0: int, compressed, index_keys, cos, sin):
        """Queries at `positions` (the first is keys' row row0; keys' row 0 is position key0) over their window
        rows of keys and the compressed entries their last query sees -> o [t, N, D]."""
        W = self.cfg.sliding_window
        lo, hi = max(0, row0 - W + 1), row0 + q.shape[0]
        key_pos = torch.arange(key0 + lo, key0 + hi, device=q.device)
        delta = positions[:, None] - key_pos[None, :]
        visible = (delta >= 0) & (delta < W)                                    # [t, hi - lo]
        span = keys[lo:hi]
        if compressed is None:
            return self._attend(q, span, visible)
        m = self.compressor.ratio
        last = key0 + row0 + q.shape[0] - 1                                     # the tile's last position
        S = min(compressed.shape[0], (last + 1) // m)                           # entries it sees
        if self.indexer is not None:   # each query reads only the entries the indexer keeps
            top, valid = self.indexer.select(x, q_lat, index_keys[:S], positions, cos, sin, self.rope)   # [t, k]
            return self._attend(q, span, visible, compressed[top], valid)
        seen = (torch.arange(S, device=q.device)[None, :] + 1) * m <= positions[:, None] + 1
        return self._attend(q, torch.cat([span, compressed[:S]]), torch.cat([visible, seen], dim=1))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, picked: torch.Tensor | None = None,
                picked_valid: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, N, D] over keys [S', D] shared by the queries (visible [T, S']) and, for CSA, per query picked
        entries [T, k, D] (picked_valid [T, k]); the sink takes its share -> o [T, N, D]. K = V."""
        scale = self.cfg.head_dim ** -0.5
        logits = torch.einsum("tnd,sd->tns", q.float(), keys.float()) * scale
        parts = [logits.masked_fill(~visible[:, None], float("-inf"))]
        if picked is not None:
            own = torch.einsum("tnd,tkd->tnk", q.float(), picked.float()) * scale
            parts.append(own.masked_fill(~picked_valid[:, None], float("-inf")))
        T = q.shape[0]
        parts.append(self.attn_sink.float().view(1, -1, 1).expand(T, -1, 1))
        probs = torch.cat(parts, dim=-1).softmax(-1)                            # [T, N, S' (+ k) + 1]
        S = keys.shape[0]
        out = torch.einsum("tns,sd->tnd", probs[..., :S], keys.float())
        if picked is not None:
            out = out + torch.einsum("tnk,tkd->tnd", probs[..., S:-1], picked.float())
        return out.to(q.dtype)
