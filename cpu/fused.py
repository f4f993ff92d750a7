"""A decoder layer's halves, and a decode step's whole stack of layers, each as one C call (built by
cpu/build.py after cpu/gemm.py's and cpu/layers.py's C, whose kernels they call), each launcher below
the source it runs. What they replace: the dozens of small torch ops and Python calls between a
layer's kernels, which inside a decode step cost ~10x what they cost alone (every layer's weight stream
empties the caches the interpreter runs from). They make exactly the kernel calls of the operation-by-
operation path, in its order (docs/kernels.md).

Legend: T tokens (each the only query of its sequence on decode steps), H hidden, E experts, k top-k,
I moe_intermediate_size, Is a SwiGLU's intermediate size. Float32 CPU tensors, contiguous. A layer's
weights go to C as a struct made once (…_weights, kept by the module while its weights are the same
memory); scratch is this thread's, shared by all calls (scratch()).
  mla_layer(x, MlaWeights, w_uk_t, cos, sin, pool, ...) -> h, mlp_in   the attention half (MLA.decode_layer)
  moe_layer(h, x, MoeWeights, load) -> out, ids, wts     the MoE half on one EP rank (MoELayer.decode_layer)
  mlp_layer(h, x, MlpWeights) -> out                     a dense layer's MLP half, h + MLP(x) (DecoderLayer)
  decode_stack(x, layers, ...) -> out, ids, wts          every layer of a decode step (DeepseekModel.op_layers)
Tests: tests/cpu/test_kernels.py (mla_layer), test_moe_layer.py, test_decode_stack.py, test_cpu_e2e.py.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .build import library, register
from .layers import _METHODS, _bad_tables

SOURCE = r"""
/* One decode step of an MLA layer around its attention (attention_mla/mla.py MLA.decode_layer): T
   tokens, each the only query of its sequence, a float32 cache. h = x + o_proj(attention(input_norm(x)))
   and mlp_in = post_norm(h): the same kernels, in the same order, as the unfused path (q-LoRA or q_proj,
   kv_a, the two RoPEs, the cache write, the absorbed query, mla_decode, W_UV, o_proj), in one call.
   The layer's weights and sizes in a struct made once (cpu/fused.py MlaWeights): wq is q_b_proj
   [N (dn+R), Q] (Q > 0, after wqa [Q, H]) or q_proj [N (dn+R), H] (Q = 0); wkvb kv_b_proj [N (dn+dv), C];
   wuk_t [N, C, dn] apart (MLA.w_uk_t, made again when kv_b_proj changes). buf: T (2H + Q + N(dn+R) +
   2(C+R) + R + NR + N(C+R) + NC + N dv) + N (max_len + 1) floats. Returns 0; -1 (wd_mla_decode's: a
   length or block id out of range, nothing attended); -2 - t when token t's slot is outside the pool's
   S rows (nothing written). */
typedef struct {
    const float *in_w, *post_w, *wqa, *qa_w, *wq, *wkva, *kva_w, *wkvb, *wo;
    float in_eps, post_eps, qa_eps, kva_eps, scale;
    int64_t H, Q, N, dn, R, C, dv, interleave;
} mla_weights;

int64_t wd_mla_layer(const mla_weights *w, const float *wuk_t, const float *x, int64_t T, const float *cos,
                     const float *sin, float *pool, int64_t S, const int64_t *slots, const int64_t *table,
                     int64_t max_blocks, const int32_t *lens, int64_t max_len, int64_t bs, float *h, float *mlp_in,
                     float *buf) {
    int64_t H = w->H, Q = w->Q, N = w->N, dn = w->dn, R = w->R, C = w->C, dv = w->dv;
    int64_t D = C + R, dq = dn + R;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= S) return -2 - t;
    float *xn = buf, *qa = xn + T * H, *q = qa + T * Q, *kv = q + T * N * dq, *lat = kv + T * D,
          *kpe = lat + T * D, *qpe = kpe + T * R, *qabs = qpe + T * N * R, *olat = qabs + T * N * D,
          *o = olat + T * N * C, *y = o + T * N * dv, *msc = y + T * H;
    wd_rmsnorm(x, H, w->in_w, xn, H, T, H, w->in_eps);
    if (Q) {
        linear(xn, H, w->wqa, H, qa, Q, T, Q, H);
        wd_rmsnorm(qa, Q, w->qa_w, qa, Q, T, Q, w->qa_eps);
        linear(qa, Q, w->wq, Q, q, N * dq, T, N * dq, Q);
    } else {
        linear(xn, H, w->wq, H, q, N * dq, T, N * dq, H);
    }
    linear(xn, H, w->wkva, H, kv, D, T, D, H);
    wd_rmsnorm(kv, D, w->kva_w, lat, D, T, C, w->kva_eps);                 /* the normed latent c */
    wd_rope(kv + C, T, 1, R, D, R, cos, sin, kpe, (int)w->interleave);      /* k_pe */
    for (int64_t t = 0; t < T; t++) {
        memcpy(lat + t * D + C, kpe + t * R, R * sizeof(float));
        memcpy(pool + slots[t] * D, lat + t * D, D * sizeof(float));
    }
    wd_rope(q + dn, T, N, R, N * dq, dq, cos, sin, qpe, (int)w->interleave);  /* q_pe [T, N, R] */
    wd_bmm_nt(N, q, dq, N * dq, wuk_t, C * dn, dn, qabs, D, N * D, T, C, dn);   /* q_nope W_UK per head */
    for (int64_t t = 0; t < T * N; t++) memcpy(qabs + t * D + C, qpe + t * R, R * sizeof(float));
    int64_t rc = wd_mla_decode(qabs, T, N, D, C, pool, S / bs, table, max_blocks, lens, max_len, bs, w->scale, olat,
                               msc, NULL, 0, 0, 0, 0, NULL);
    if (rc) return rc;
    wd_bmm_nt(N, olat, C, N * C, w->wkvb + dn * C, (dn + dv) * C, C, o, dv, N * dv, T, dv, C);   /* W_UV */
    linear(o, N * dv, w->wo, N * dv, y, H, T, H, N * dv);
    for (int64_t i = 0; i < T * H; i++) h[i] = x[i] + y[i];
    wd_rmsnorm(h, H, w->post_w, mlp_in, H, T, H, w->post_eps);
    return 0;
}

/* An MoE layer's half on one EP rank (moe/layer.py MoELayer.decode_layer): T tokens, every expert local
   and physical id = logical id. ids, wts = route(x) (wd_route); out = h + (experts(x) + shared(x)) with
   the shared experts' SwiGLU (sg, su [Is, H], sd [H, Is]; sg NULL: none): the kernels and the order of
   the operation-by-operation path. The layer's weights and router settings in a struct made once
   (cpu/fused.py MoeWeights). load [E] (NULL: off) += 1 per chosen id, as MoELayer.route counts for
   EPLB. iscratch: 2 (E + 1) + T k ints; scratch: T (E + H + max(2H + 3I, H + 2 Is)) floats. Returns 0
   (wd_experts' error codes cannot occur: the router's ids are < E). */
/* y [T, H] = sd @ (silu(sg @ x) * (su @ x)) for x [T, H], sg, su [Is, H], sd [H, Is] (moe/mlp.py MLP). scratch:
   2 T Is floats. */
static void swiglu(const float *x, int64_t T, int64_t H, const float *sg, const float *su, const float *sd,
                   int64_t Is, float *y, float *scratch) {
    float *g = scratch, *u = g + T * Is;
    linear(x, H, sg, H, g, Is, T, Is, H);
    linear(x, H, su, H, u, Is, T, Is, H);
    for (int64_t i = 0; i < T * Is; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    linear(g, Is, sd, Is, y, H, T, H, Is);
}

typedef struct {
    const float *gw, *gbias, *w13, *w2, *sg, *su, *sd;
    float scale;
    int64_t H, E, I, Is, k, G, topk_group, sigmoid, method, norm;
} moe_weights;

int64_t wd_moe_layer(const moe_weights *w, const float *h, const float *x, int64_t T, int64_t *load, float *out,
                     int64_t *ids, float *wts, int64_t *iscratch, float *scratch) {
    int64_t H = w->H, E = w->E, I = w->I, Is = w->Is, k = w->k;
    float *logits = scratch, *ye = logits + T * E, *rest = ye + T * H;
    wd_route(x, T, H, w->gw, E, w->gbias, (int)w->sigmoid, (int)w->method, w->G, w->topk_group, k, (int)w->norm,
             w->scale, logits, ids, wts);
    if (load)
        for (int64_t p = 0; p < T * k; p++) load[ids[p]]++;
    memset(ye, 0, T * H * sizeof(float));
    int64_t rc = wd_experts(x, T, H, I, E, w->w13, w->w2, ids, wts, k, ye, iscratch, rest);
    if (rc) return rc;
    if (!w->sg) {
        for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + ye[i];
        return 0;
    }
    float *y = rest;
    swiglu(x, T, H, w->sg, w->su, w->sd, Is, y, y + T * H);
    for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + (ye[i] + y[i]);
    return 0;
}

/* A dense layer's MLP half: out = h + MLP(x) (moe/mlp.py MLP on the cpu backend). */
typedef struct {
    const float *sg, *su, *sd;
    int64_t H, Is;
} mlp_weights;

static void mlp_half(const mlp_weights *w, const float *h, const float *x, int64_t T, float *out, float *scratch) {
    int64_t H = w->H;
    float *y = scratch;
    swiglu(x, T, H, w->sg, w->su, w->sd, w->Is, y, y + T * H);
    for (int64_t i = 0; i < T * H; i++) out[i] = h[i] + y[i];
}

void wd_mlp_layer(const mlp_weights *w, const float *h, const float *x, int64_t T, float *out, float *scratch) {
    mlp_half(w, h, x, T, out, scratch);
}

/* A whole decode step's decoder layers, one call (engine/model/model.py DeepseekModel.op_layers): layer l's
   attention half (wd_mla_layer) then its MoE half (wd_moe_layer) or dense MLP half (mlp_half), each
   layer's output the next one's input, exactly the calls the per-layer path makes. layers[l]: its
   structs (mlp NULL for an MoE layer), W_UK^T, its cache pool [S, C+R] and EPLB counts (or NULL).
   x0 [T, H] in, out [T, H] the last layer's output; ids, wts [n_moe, T, k] the MoE layers' routing.
   buf: T (4 H) + the largest scratch of a layer; ibuf: the MoE layers' int scratch. Returns 0, or a
   layer's error code (wd_mla_layer's) with *failed = its layer (earlier layers have run). */
typedef struct {
    const mla_weights *mla;
    const float *wuk_t;
    float *pool;
    int64_t S;
    const moe_weights *moe;
    const mlp_weights *mlp;
    int64_t *load;
} layer_desc;

int64_t wd_decode_stack(const layer_desc *layers, int64_t L, const float *x0, int64_t T, const float *cos,
                        const float *sin, const int64_t *slots, const int64_t *table, int64_t max_blocks,
                        const int32_t *lens, int64_t max_len, int64_t bs, float *out, int64_t *ids, float *wts,
                        float *buf, int64_t *ibuf, int64_t *failed) {
    int64_t H = layers[0].mla->H;
    float *h = buf, *mlp_in = h + T * H, *xa = mlp_in + T * H, *xb = xa + T * H, *scratch = xb + T * H;
    const float *x = x0;
    for (int64_t l = 0, m = 0; l < L; l++) {
        const layer_desc *d = layers + l;
        int64_t rc = wd_mla_layer(d->mla, d->wuk_t, x, T, cos, sin, d->pool, d->S, slots, table, max_blocks, lens,
                                  max_len, bs, h, mlp_in, scratch);
        if (rc) { *failed = l; return rc; }
        float *dst = l == L - 1 ? out : (l % 2 ? xb : xa);
        if (d->moe) {
            int64_t k = d->moe->k;
            wd_moe_layer(d->moe, h, mlp_in, T, d->load, dst, ids + m * T * k, wts + m * T * k, ibuf, scratch);
            m++;
        } else {
            mlp_half(d->mlp, h, mlp_in, T, dst, scratch);
        }
        x = dst;
    }
    return 0;
}
"""
P, I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {"wd_mla_layer": ([P, P, P, I, P, P, P, I, P, P, I, P, I, I, P, P, P], I),
              "wd_moe_layer": ([P, P, P, I, P, P, P, P, P, P], I),
              "wd_mlp_layer": ([P, P, P, I, P, P], None),
              "wd_decode_stack": ([P, I, P, I, P, P, P, P, I, P, I, I, P, P, P, P, P, P], I)}
register(SOURCE, SIGNATURES)


class MlaWeights(ctypes.Structure):
    """wd_mla_layer's per-layer arguments (its mla_weights struct): made once by mla_layer_weights,
    kept by the caller while the weights are the same memory."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("in_w", "post_w", "wqa", "qa_w", "wq", "wkva", "kva_w", "wkvb", "wo")] \
        + [(n, ctypes.c_float) for n in ("in_eps", "post_eps", "qa_eps", "kva_eps", "scale")] \
        + [(n, ctypes.c_int64) for n in ("H", "Q", "N", "dn", "R", "C", "dv", "interleave")]


def mla_layer_weights(in_norm, post_norm, mla) -> MlaWeights:
    """The layer's RMSNorm modules and its MLA (attention_mla/mla.py, read by its fields) -> the
    struct mla_layer takes (pointers to the weights, their sizes, eps, the softmax scale)."""
    cfg = mla.cfg
    Q = cfg.q_lora_rank or 0
    wq = mla.q_b_proj.weight if Q else mla.q_proj.weight
    return MlaWeights(
        in_norm.weight.data_ptr(), post_norm.weight.data_ptr(), mla.q_a_proj.weight.data_ptr() if Q else None,
        mla.q_a_layernorm.weight.data_ptr() if Q else None, wq.data_ptr(), mla.kv_a_proj_with_mqa.weight.data_ptr(),
        mla.kv_a_layernorm.weight.data_ptr(), mla.kv_b_proj.weight.data_ptr(), mla.o_proj.weight.data_ptr(),
        in_norm.eps, post_norm.eps, mla.q_a_layernorm.eps if Q else 0.0, mla.kv_a_layernorm.eps, cfg.softmax_scale,
        in_norm.weight.shape[0], Q, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
        cfg.v_head_dim, int(mla.rope.cfg.interleave))


def mla_layer_buffer(w: MlaWeights, T: int, max_len: int) -> int:
    """Floats of scratch mla_layer needs for T tokens and contexts of up to max_len."""
    D = w.C + w.R
    return (T * (2 * w.H + w.Q + w.N * (w.dn + w.R) + 2 * D + w.R + w.N * w.R + w.N * D + w.N * w.C + w.N * w.dv)
            + w.N * (max_len + 1))


def f32_rows(t: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether t is what the fused calls read as [rows, cols]: float32, on the CPU, contiguous."""
    return t.dtype == torch.float32 and not t.is_cuda and t.is_contiguous() and t.shape == (rows, cols)


_scratch = threading.local()   # this thread's scratch for the fused layers: one buffer for all of them


def scratch(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """At least n elements of this thread's scratch of `dtype` (grown in steps of 1/4, so that a context
    growing by a token a step does not reallocate every step). Valid until the next call."""
    name = "i64" if dtype == torch.int64 else "f32"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n + n // 4 + 1024, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


def mla_layer(x: torch.Tensor, w: MlaWeights, w_uk_t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kv_pool: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, max_len: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (each token the only query of its sequence), the layer's weights (mla_layer_weights)
    and W_UK^T (MLA.w_uk_t), cos/sin [T, R/2], a float32 pool [S, C+R], slots [T], table [T, M], lens [T]
    int32 (AttnMeta.seq_tables) -> (h [T, H], mlp_in [T, H]): the decoder layer's attention half in one
    call (MLA.decode_layer checks that every weight and input fits)."""
    T, H = x.shape
    h, mlp_in = torch.empty(T, H), torch.empty(T, H)
    buf = scratch(mla_layer_buffer(w, T, max_len))
    rc = library().wd_mla_layer(
        ctypes.byref(w), w_uk_t.data_ptr(), x.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), kv_pool.data_ptr(),
        kv_pool.shape[0], slots.data_ptr(), table.data_ptr(), table.shape[1], lens.data_ptr(), max_len, block_size,
        h.data_ptr(), mlp_in.data_ptr(), buf.data_ptr())
    if rc <= -2:
        raise ValueError(f"mla_layer: token {-2 - rc}'s slot {int(slots[-2 - rc])} is outside the pool's "
                         f"{kv_pool.shape[0]} rows")
    if rc:
        raise _bad_tables("mla_layer", lens, table, max_len, block_size, kv_pool.shape[0] // block_size)
    return h, mlp_in


class MoeWeights(ctypes.Structure):
    """wd_moe_layer's per-layer arguments (its moe_weights struct): made once by moe_layer_weights,
    kept by the caller while the weights are the same memory."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("gw", "gbias", "w13", "w2", "sg", "su", "sd")] \
        + [("scale", ctypes.c_float)] \
        + [(n, ctypes.c_int64) for n in ("H", "E", "I", "Is", "k", "G", "topk_group", "sigmoid", "method", "norm")]


def moe_layer_weights(gate, w13: torch.Tensor, w2: torch.Tensor, shared) -> MoeWeights:
    """The router (moe/gate.py Gate, read by its fields), w13 [E, 2I, H], w2 [E, H, I] with every
    expert local, the shared experts (a moe/mlp.py MLP read by its fields, or None) -> the struct
    moe_layer takes."""
    cfg, bias = gate.cfg, gate.e_score_correction_bias
    E, I2, H = w13.shape
    sw = ((shared.gate_proj.weight.data_ptr(), shared.up_proj.weight.data_ptr(), shared.down_proj.weight.data_ptr())
          if shared is not None else (None, None, None))
    return MoeWeights(gate.weight.data_ptr(), None if bias is None else bias.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                      *sw, cfg.routed_scaling_factor, H, E, I2 // 2,
                      shared.gate_proj.weight.shape[0] if shared is not None else 0, cfg.top_k, cfg.n_group,
                      cfg.topk_group, int(cfg.scoring_func == "sigmoid"), _METHODS[cfg.topk_method],
                      int(cfg.norm_topk_prob))


def moe_layer_scratch(w: MoeWeights, T: int) -> tuple[int, int]:
    """(int64s, floats) of scratch moe_layer needs for T tokens."""
    return 2 * (w.E + 1) + T * w.k, T * (w.E + w.H + max(2 * w.H + 3 * w.I, 2 * w.Is + w.H))


def moe_layer(h: torch.Tensor, x: torch.Tensor, w: MoeWeights, load_counts: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, x [T, H] (the residual and the post-attention-normed mlp_in), the layer's weights
    (moe_layer_weights), load_counts [E] int64 or None -> (h + MoE(x) [T, H], topk_ids [T, k],
    topk_weights [T, k]): route, routed and shared experts, residual in one call (MoELayer.decode_layer
    checks that every weight and input fits)."""
    T, H = x.shape
    out, ids, wts = torch.empty(T, H), torch.empty(T, w.k, dtype=torch.int64), torch.empty(T, w.k)
    ni, nf = moe_layer_scratch(w, T)
    rc = library().wd_moe_layer(ctypes.byref(w), h.data_ptr(), x.data_ptr(), T,
                                None if load_counts is None else load_counts.data_ptr(), out.data_ptr(),
                                ids.data_ptr(), wts.data_ptr(), scratch(ni, torch.int64).data_ptr(),
                                scratch(nf).data_ptr())
    if rc:
        raise RuntimeError(f"moe_layer: the router chose an expert past the {w.E} local ones (kernel code {rc})")
    return out, ids, wts


class MlpWeights(ctypes.Structure):
    """A dense layer's SwiGLU MLP for wd_decode_stack (its mlp_weights struct): mlp_layer_weights."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("sg", "su", "sd")] + [(n, ctypes.c_int64) for n in ("H", "Is")]


def mlp_layer_weights(mlp) -> MlpWeights:
    """A moe/mlp.py MLP (read by its fields) -> the struct decode_stack takes for a dense layer."""
    g = mlp.gate_proj.weight
    return MlpWeights(g.data_ptr(), mlp.up_proj.weight.data_ptr(), mlp.down_proj.weight.data_ptr(), g.shape[1],
                      g.shape[0])


def mlp_layer_scratch(w: MlpWeights, T: int) -> int:
    """Floats of scratch a dense layer's MLP half needs for T tokens."""
    return T * (w.H + 2 * w.Is)


def mlp_layer(h: torch.Tensor, x: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """h, x [T, H] (the residual and the post-attention-normed mlp_in), a dense layer's MLP
    (mlp_layer_weights) -> h + MLP(x) [T, H] in one call (the SwiGLU of the shared experts)."""
    T, H = x.shape
    out = torch.empty(T, H)
    library().wd_mlp_layer(ctypes.byref(w), h.data_ptr(), x.data_ptr(), T, out.data_ptr(),
                           scratch(mlp_layer_scratch(w, T)).data_ptr())
    return out


class LayerDesc(ctypes.Structure):
    """One decoder layer for wd_decode_stack: its structs (by address; the caller keeps them alive), its
    W_UK^T, its cache pool and EPLB counts."""
    _fields_ = [("mla", ctypes.c_void_p), ("wuk_t", ctypes.c_void_p), ("pool", ctypes.c_void_p),
                ("S", ctypes.c_int64), ("moe", ctypes.c_void_p), ("mlp", ctypes.c_void_p), ("load", ctypes.c_void_p)]


def decode_stack(x: torch.Tensor, layers, mla: list[MlaWeights], moe: list[MoeWeights | None],
                 mlp: list[MlpWeights | None], cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor, max_len: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's decoder layers in one call: x [T, H] (the embeddings), `layers` a ctypes array of
    LayerDesc (one a layer, in order; mla/moe/mlp the structs they point at, for the scratch sizes),
    cos/sin [T, R/2], slots [T], table [T, M], lens [T] int32 (AttnMeta.decode_tables) -> (the last
    layer's output [T, H], the MoE layers' topk_ids and topk_weights [n_moe, T, k]). Every layer runs
    what mla_layer and moe_layer (or the dense MLP) run, in order (DeepseekModel.op_layers checks that
    every layer fits)."""
    T, H = x.shape
    moes = [w for w in moe if w is not None]
    k = moes[0].k if moes else 1
    need = max([mla_layer_buffer(w, T, max_len) for w in mla] + [moe_layer_scratch(w, T)[1] for w in moes]
               + [mlp_layer_scratch(w, T) for w in mlp if w is not None])
    ineed = max([moe_layer_scratch(w, T)[0] for w in moes], default=1)
    out = torch.empty(T, H)
    ids, wts = torch.empty(len(moes), T, k, dtype=torch.int64), torch.empty(len(moes), T, k)
    failed = ctypes.c_int64(-1)
    rc = library().wd_decode_stack(
        layers, len(mla), x.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), table.data_ptr(),
        table.shape[1], lens.data_ptr(), max_len, block_size, out.data_ptr(), ids.data_ptr(), wts.data_ptr(),
        scratch(4 * T * H + need).data_ptr(), scratch(ineed, torch.int64).data_ptr(), ctypes.byref(failed))
    if rc <= -2:
        pool_rows = layers[failed.value].S
        raise ValueError(f"decode_stack: layer {failed.value}: token {-2 - rc}'s slot {int(slots[-2 - rc])} is "
                         f"outside the pool's {pool_rows} rows")
    if rc:
        raise _bad_tables(f"decode_stack: layer {failed.value}", lens, table, max_len, block_size,
                          layers[failed.value].S // block_size)
    return out, ids, wts
