"""RMSNorm, rotary embedding and the absorbed MLA decode over the paged latent cache, in C (built by
cpu/build.py with cpu/gemm.py's source, whose vector helpers and streamed GEMM they use), each launcher
below the source it runs. They replace several torch ops per call (norms and rope: one pass instead of
six or ten) and read the latent cache through the block table instead of gathering it.

Legend: T tokens, Hh heads of a tensor, R rope dim, B decode sequences, Nh heads, D = C + R latent
width, C kv_lora_rank, S cache slots. Float32 CPU tensors, last dim contiguous.
  rmsnorm(x [..., N], weight [N], eps) -> [..., N]             = RMSNorm (attention_mla/norm.py)
  rope(x [T, (Hh,) R], cos, sin [T, R/2], interleave)          = RotaryEmbedding.apply (attention_mla/rope.py)
  mla_decode(q [B, Nh, D], kv_pool [S, D], ...) -> [B, Nh, C]  = paged_decode_reference (attention_mla/paged_decode.py)
      (or kv_pool an fp8 cache's packed rows, dequantised block by block, 16 values per vector op)
  route(x [T, H], weight [E, H], bias, cfg) -> ids, weights    = moe/gate.py Gate
  mla_layer(x [T, H], MlaWeights, ...) -> h, mlp_in           = a decoder layer's attention half on decode steps
  moe_layer(h, x [T, H], MoeWeights, load) -> out, ids, wts    = its MoE half on one EP rank (MoELayer.decode_layer)
  mlp_layer(h, x [T, H], MlpWeights) -> out                    = a dense layer's MLP half (h + MLP(x))
  decode_stack(x [T, H], layers, ...) -> out, ids, wts         = every decoder layer of a decode step, one call
      (their weights in a C struct made once per layer: mla_layer_weights, moe_layer_weights)
Tests: tests/cpu/.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .build import library, register
from .gemm import check_float32

SOURCE = r"""
/* y [M, N] = w * x * rsqrt(mean(x^2) + eps) per row (rows ldx / ldy apart) */
void wd_rmsnorm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                float eps) {
    int64_t N16 = N & ~(int64_t)15;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        v16 acc = bc(0);
        for (int64_t n = 0; n < N16; n += 16) { v16 v = ld(xr + n); acc += v * v; }
        if (N16 < N) { v16 v = ld_part(xr + N16, N - N16); acc += v * v; }
        float ss = 0;
        for (int l = 0; l < 16; l++) ss += acc[l];
        v16 r = bc(1.0f / sqrtf(ss / N + eps));
        for (int64_t n = 0; n < N16; n += 16) st(yr + n, ld(w + n) * (ld(xr + n) * r));
        for (int64_t n = N16; n < N; n++) yr[n] = w[n] * (xr[n] * r[0]);
    }
}

/* Rotary embedding: x [T, Hh, R] (strides sxt, sxh; unit last) -> y [T, Hh, R] contiguous, cos/sin
   [T, R/2] contiguous. interleave: pairs (x[2i], x[2i+1]); else halves (x[i], x[i + R/2]). */
void wd_rope(const float *x, int64_t T, int64_t Hh, int64_t R, int64_t sxt, int64_t sxh, const float *cos,
             const float *sin, float *y, int interleave) {
    int64_t h2 = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * h2, *sn = sin + t * h2;
        for (int64_t h = 0; h < Hh; h++) {
            const float *xr = x + t * sxt + h * sxh;
            float *yr = y + (t * Hh + h) * R;
            for (int64_t i = 0; i < h2; i++) {
                int64_t a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + h2;
                float x1 = xr[a], x2 = xr[b];
                yr[a] = x1 * c[i] - x2 * sn[i];
                yr[b] = x2 * c[i] + x1 * sn[i];
            }
        }
    }
}

/* e4m3 bytes -> float: the byte's exponent and mantissa bits placed at the top of a float32's exponent
   and mantissa give the value times 2^-120 (e4m3 subnormals land on float32 subnormals, exactly), so
   one shift and one multiply by scale * 2^120 dequantise; 16 at a time. (0x7f / 0xff, e4m3's NaN, read
   as +-480: the quantiser never writes them.) */
#define FP8_ROWS 16   /* rows dequantised at a time: 16 x 576 floats stay in L1 */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
static inline v16 e4m3x16(const uint8_t *p, v16 scale) {
    u8x16 b;
    memcpy(&b, p, 16);
    i16 w = __builtin_convertvector(b, i16);
    i16 bits = ((w & 0x80) << 24) | ((w & 0x7f) << 20);
    v16 f;
    memcpy(&f, &bits, 64);
    return f * scale;
}
static inline float e4m3(uint8_t b, float scale) {
    uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * scale;
}

/* Rows [first, first + n) of a packed fp8 pool (attention_mla/fp8_cache.py: W bytes a row, e4m3 c [C],
   float32 scales at soff, one per `group` values, fp32 k_pe [D - C] at roff) as floats kb [n, D]. */
static const float *fp8_rows(const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t group,
                             int64_t C, int64_t D, int64_t first, int64_t n, float *kb) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = pool8 + (first + i) * W;
        float *o = kb + i * D;
        for (int64_t g = 0; g < C; g += group) {
            float sg;
            memcpy(&sg, r + soff + g / group * 4, 4);
            sg *= 0x1p120f;
            int64_t c = g;
            for (; c + 16 <= g + group; c += 16) st(o + c, e4m3x16(r + c, bc(sg)));
            for (; c < g + group; c++) o[c] = e4m3(r[c], sg);
        }
        memcpy(o + C, r + roff, (D - C) * sizeof(float));
    }
    return kb;
}

/* o[h, :16 NV] += sum over the nj rows j of p[h * L + j] * row_j[:16 NV], for NH heads (rows D apart,
   heads' scores L apart, outputs C apart): a tile of NH x NV accumulators stays in registers for the
   whole run of rows, each row's vectors loaded once for all NH heads. */
#define PV_TILE(NH, NV)                                                                            \
static inline void pv_##NH##_##NV(const float *rows, int64_t D, int64_t nj, const float *p, int64_t L, \
                                  float *o, int64_t C) {                                           \
    v16 acc[NH][NV];                                                                               \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) acc[h][v] = ld(o + h * C + 16 * v);  \
    for (int64_t j = 0; j < nj; j++) {                                                             \
        v16 r[NV];                                                                                 \
        for (int v = 0; v < NV; v++) r[v] = ld(rows + j * D + 16 * v);                             \
        for (int h = 0; h < NH; h++) {                                                             \
            v16 pv = bc(p[h * L + j]);                                                             \
            for (int v = 0; v < NV; v++) acc[h][v] += pv * r[v];                                   \
        }                                                                                          \
    }                                                                                              \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) st(o + h * C + 16 * v, acc[h][v]);   \
}
PV_TILE(4, 4) PV_TILE(4, 1) PV_TILE(1, 4) PV_TILE(1, 1)

/* Absorbed MLA decode over the paged latent cache, one query token per sequence: scores = q . latent
   over the sequence's blocks (read through the block table, never gathered), fp32 softmax, out =
   p @ latent[:, :C]. scratch: Nh * (max_len + 1) floats. pool8 (else NULL): the cache is packed fp8
   rows instead of pool, and each block is dequantised into kb [bs, D] as it is read, once for the
   scores and once for the output. Returns 0, or -1 (nothing computed) when a
   length is outside 1 .. max_len or a block id it needs is outside the pool. */
int64_t wd_mla_decode(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const float *pool,
                      int64_t num_blocks, const int64_t *table, int64_t max_blocks, const int32_t *lens,
                      int64_t max_len, int64_t bs, float scale, float *out, float *scratch,
                      const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t group, float *kb) {
    int64_t C16 = C & ~(int64_t)15;
    for (int64_t b = 0; b < B; b++) {      /* nothing outside the pool or the scratch is ever read */
        if (lens[b] < 1 || lens[b] > max_len || (lens[b] - 1) / bs >= max_blocks) return -1;
        for (int64_t i = 0; i <= (lens[b] - 1) / bs; i++)
            if (table[b * max_blocks + i] < 0 || table[b * max_blocks + i] >= num_blocks) return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b];
        float *inv = scratch + Nh * L;
        const float *qb = q + b * Nh * D;
        float *ob = out + b * Nh * C, *sc = scratch;
        /* rows j0 .. j0 + n - 1 (never past their block): in place, or dequantised into kb (in L1) */
#define ROWS(j0, n) (pool8 ? fp8_rows(pool8, W, soff, roff, group, C, D, table[b * max_blocks + (j0) / bs] * bs \
                                      + (j0) % bs, n, kb) : pool + (table[b * max_blocks + (j0) / bs] * bs + (j0) % bs) * D)
#define CHUNK(j0) (L - (j0) < step - (j0) % step ? L - (j0) : step - (j0) % step)
        int64_t step = pool8 && bs > FP8_ROWS ? FP8_ROWS : bs;
        for (int64_t j0 = 0; j0 < L; j0 += CHUNK(j0)) linear(qb, D, ROWS(j0, CHUNK(j0)), D, sc + j0, L, Nh, CHUNK(j0), D);
        for (int64_t n = 0; n < Nh; n++) {       /* p = exp((s - max) * scale); the 1 / sum comes last */
            float *s = sc + n * L, mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
            v16 acc = bc(0);
            int64_t j = 0;
            for (; j + 16 <= L; j += 16) {
                v16 e = vexp((ld(s + j) - bc(mx)) * bc(scale));
                st(s + j, e);
                acc += e;
            }
            for (int l = 0; l < 16; l++) sum += acc[l];
            for (; j < L; j++) { s[j] = expf((s[j] - mx) * scale); sum += s[j]; }
            inv[n] = 1.0f / sum;
        }
        memset(ob, 0, Nh * C * sizeof(float));
        for (int64_t j0 = 0, nj; j0 < L; j0 += nj) {
            nj = CHUNK(j0);
            const float *blk = ROWS(j0, nj);
            for (int64_t c0 = 0, wide; c0 < C16; c0 += wide ? 64 : 16) {
                wide = C16 - c0 >= 64;
                for (int64_t n0 = 0, four; n0 < Nh; n0 += four ? 4 : 1) {
                    four = Nh - n0 >= 4;
                    const float *p = sc + n0 * L + j0;
                    float *o = ob + n0 * C + c0;
                    if (four && wide) pv_4_4(blk + c0, D, nj, p, L, o, C);
                    else if (four) pv_4_1(blk + c0, D, nj, p, L, o, C);
                    else if (wide) pv_1_4(blk + c0, D, nj, p, L, o, C);
                    else pv_1_1(blk + c0, D, nj, p, L, o, C);
                }
            }
            for (int64_t j = j0; j < j0 + nj; j++)
                for (int64_t n = 0; n < Nh; n++)
                    for (int64_t c = C16; c < C; c++) ob[n * C + c] += sc[n * L + j] * blk[(j - j0) * D + c];
        }
#undef ROWS
#undef CHUNK
        for (int64_t n = 0; n < Nh; n++)
            for (int64_t c = 0; c < C; c++) ob[n * C + c] *= inv[n];
    }
    return 0;
}

/* The router (moe/gate.py Gate), fused. logits [T, E] = x [T, H] @ w [E, H]^T (scratch); per token:
   scores (softmax or sigmoid), choice = scores + bias (when given); grouped methods keep the
   topk_group groups with the best group score (method 1: the group's max, 2: the sum of its top
   two) and hide the rest; the top k of choice (descending, the lower id first among equals) are
   the ids, their unbiased scores the weights (renormalised when norm, times scale). */
static int64_t best_of(const float *v, const unsigned char *taken, int64_t n) {
    int64_t b = -1;
    for (int64_t e = 0; e < n; e++)
        if (!taken[e] && (b < 0 || v[e] > v[b])) b = e;
    return b;
}

void wd_route(const float *x, int64_t T, int64_t H, const float *w, int64_t E, const float *bias,
              int sigmoid, int method, int64_t G, int64_t topk_group, int64_t k, int norm, float scale,
              float *logits, int64_t *ids, float *wts) {
    linear(x, H, w, H, logits, E, T, E, H);
    float choice[E], gscore[G > 0 ? G : 1];
    unsigned char taken[E], gtaken[G > 0 ? G : 1];
    int64_t per = G > 0 ? E / G : E;
    for (int64_t t = 0; t < T; t++) {
        float *sc = logits + t * E;
        if (sigmoid) {
            for (int64_t e = 0; e < E; e++) sc[e] = 1.0f / (1.0f + expf(-sc[e]));
        } else {
            float mx = sc[0], sum = 0;
            for (int64_t e = 1; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
            for (int64_t e = 0; e < E; e++) { sc[e] = expf(sc[e] - mx); sum += sc[e]; }
            for (int64_t e = 0; e < E; e++) sc[e] /= sum;
        }
        for (int64_t e = 0; e < E; e++) { choice[e] = bias ? sc[e] + bias[e] : sc[e]; taken[e] = 0; }
        if (method != 0 && G > 1) {
            for (int64_t g = 0; g < G; g++) {
                const float *c = choice + g * per;
                float a = c[0], b = -INFINITY;          /* the best and second best of the group */
                for (int64_t j = 1; j < per; j++) {
                    if (c[j] > a) { b = a; a = c[j]; } else if (c[j] > b) b = c[j];
                }
                gscore[g] = method == 2 ? a + b : a;
                gtaken[g] = 0;
            }
            for (int64_t i = 0; i < topk_group; i++) gtaken[best_of(gscore, gtaken, G)] = 1;
            for (int64_t g = 0; g < G; g++)
                if (!gtaken[g]) memset(taken + g * per, 1, per);   /* hidden: never chosen */
        }
        int64_t *id = ids + t * k;
        float *wt = wts + t * k, total = 0;
        for (int64_t i = 0; i < k; i++) {
            int64_t e = best_of(choice, taken, E);
            taken[e] = 1;
            id[i] = e;
            wt[i] = sc[e];
            total += sc[e];
        }
        float f = norm ? scale / (total + 1e-20f) : scale;
        for (int64_t i = 0; i < k; i++) wt[i] *= f;
    }
}

/* One decode step of an MLA layer around its attention (attention_mla/mla.py MLA.decode_layer): T
   tokens, each the only query of its sequence, a float32 cache. h = x + o_proj(attention(input_norm(x)))
   and mlp_in = post_norm(h): the same kernels, in the same order, as the unfused path (q-LoRA or q_proj,
   kv_a, the two RoPEs, the cache write, the absorbed query, mla_decode, W_UV, o_proj), in one call.
   The layer's weights and sizes in a struct made once (cpu/layers.py MlaWeights): wq is q_b_proj
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
   (cpu/layers.py MoeWeights). load [E] (NULL: off) += 1 per chosen id, as MoELayer.route counts for
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

/* A whole decode step's decoder layers, one call (engine/model.py DeepseekModel.op_layers): layer l's
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
P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {"wd_rmsnorm": ([P, I, P, P, I, I, I, F], None),
              "wd_rope": ([P, I, I, I, I, I, P, P, P, ctypes.c_int], None),
              "wd_mla_decode": ([P, I, I, I, I, P, I, P, I, P, I, I, F, P, P, P, I, I, I, I, P], I),
              "wd_mla_layer": ([P, P, P, I, P, P, P, I, P, P, I, P, I, I, P, P, P], I),
              "wd_route": ([P, I, I, P, I, P, ctypes.c_int, ctypes.c_int, I, I, I, ctypes.c_int, F, P, P, P], None),
              "wd_moe_layer": ([P, P, P, I, P, P, P, P, P, P], I),
              "wd_mlp_layer": ([P, P, P, I, P, P], None),
              "wd_decode_stack": ([P, I, P, I, P, P, P, P, I, P, I, I, P, P, P, P, P, P], I)}
register(SOURCE, SIGNATURES)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * x * rsqrt(mean(x^2, -1) + eps) (attention_mla/norm.py RMSNorm)."""
    N = x.shape[-1]
    if not (x.dtype == weight.dtype == torch.float32 and not x.is_cuda and weight.shape == (N,)
            and weight.is_contiguous()):
        raise ValueError(f"rmsnorm: x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} {tuple(weight.shape)} must "
                         f"be float32 CPU tensors with weight [N={N}] contiguous")
    x2 = x.reshape(-1, N)
    if N and x2.shape[0] and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape)
    if out.numel():
        library().wd_rmsnorm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), out.data_ptr(), N, x2.shape[0], N,
                             eps)
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, R] or [T, Hh, R], cos/sin [T, R/2] -> rotated x, contiguous (RotaryEmbedding.apply)."""
    T, R = x.shape[0], x.shape[-1]
    x3 = x[:, None] if x.dim() == 2 else x
    if not (x.dtype == cos.dtype == sin.dtype == torch.float32 and not x.is_cuda and x3.dim() == 3 and R % 2 == 0
            and tuple(cos.shape) == tuple(sin.shape) == (T, R // 2) and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope: x {x.dtype} {tuple(x.shape)} ([T, R] or [T, Hh, R], R even) and cos/sin "
                         f"{tuple(cos.shape)} (contiguous [T, R/2]) must be float32 CPU tensors")
    if x3.numel() and x3.stride(2) != 1:
        x3 = x3.contiguous()
    out = torch.empty(x.shape)
    if out.numel():
        library().wd_rope(x3.data_ptr(), T, x3.shape[1], R, x3.stride(0), x3.stride(1), cos.data_ptr(),
                          sin.data_ptr(), out.data_ptr(), int(interleave))
    return out


def mla_decode(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, kv_lora_rank: int, scale: float, max_len: int,
               fp8=None) -> torch.Tensor:
    """q [B, Nh, D] (absorbed: [q_nope W_UK, q_pe]), kv_pool [S, D], block_table [B, M] int64 block ids,
    seq_lens [B] int32 (each in 1 .. max_len; max_len a host int; AttnMeta.seq_tables gives all three)
    -> [B, Nh, C] (fp32 softmax). fp8: an fp8 cache's row layout (attention_mla/fp8_cache.py Fp8Latent,
    read by its fields only, so cpu/ needs nothing above it): kv_pool is then its packed uint8 rows
    [S, fp8.row_bytes] (RoPE part float32), read in place: 1 byte a latent value instead of 4."""
    check_float32("q", q, 3)
    B, Nh, D = q.shape
    if fp8 is None:
        check_float32("kv_pool", kv_pool, 2)
        width, args = D, (None, 0, 0, 0, 0, None)
    else:
        if kv_pool.dtype != torch.uint8 or kv_pool.dim() != 2 or kv_pool.shape[1] != fp8.row_bytes or kv_pool.is_cuda \
                or (fp8.kv_lora_rank, fp8.kv_lora_rank + fp8.rope_dim, fp8.rope_dtype) != (kv_lora_rank, D, torch.float32):
            raise ValueError(f"mla_decode: an fp8 pool must be uint8 [S, {fp8.row_bytes}] on CPU with a float32 RoPE "
                             f"part and kv_lora_rank + rope_dim = D ({D}), got {kv_pool.dtype} {tuple(kv_pool.shape)}, "
                             f"{fp8}")
        kb = torch.empty(min(block_size, 16) * D)   # FP8_ROWS rows
        width, args = fp8.row_bytes, (kv_pool.data_ptr(), fp8.row_bytes, fp8.scale_offset, fp8.rope_offset, fp8.group,
                                      kb.data_ptr())
    if kv_pool.shape[1] != width or not 0 < kv_lora_rank <= D or not kv_pool.is_contiguous():
        raise ValueError(f"mla_decode: q {tuple(q.shape)}, kv_pool {tuple(kv_pool.shape)} (contiguous) and "
                         f"kv_lora_rank {kv_lora_rank} do not fit")
    if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != B or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"mla_decode: block_table [B={B}, M] int64 and seq_lens [B] int32, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}, {seq_lens.dtype} {tuple(seq_lens.shape)}")
    q, block_table, seq_lens = q.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    out = torch.empty(B, Nh, kv_lora_rank)
    num_blocks, scratch = kv_pool.shape[0] // block_size, torch.empty(Nh * (max_len + 1))
    if B and library().wd_mla_decode(q.data_ptr(), B, Nh, D, kv_lora_rank, kv_pool.data_ptr(), num_blocks,
                                     block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(), max_len,
                                     block_size, scale, out.data_ptr(), scratch.data_ptr(), *args):
        raise _bad_tables("mla_decode", seq_lens, block_table, max_len, block_size, num_blocks)
    return out


def _bad_tables(who: str, seq_lens: torch.Tensor, block_table: torch.Tensor, max_len: int, block_size: int,
                num_blocks: int) -> ValueError:
    """The error for lengths or block ids the C decode refused (it checks them before reading anything)."""
    lo, hi = (int(v) for v in torch.aminmax(seq_lens))
    blo, bhi = (int(v) for v in torch.aminmax(block_table))
    return ValueError(f"{who}: seq_lens in [{lo}, {hi}] (max_len {max_len}) need 1 .. {block_table.shape[1]} "
                      f"blocks of {block_size}, block ids in [{blo}, {bhi}] must be in [0, {num_blocks})")


_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [E, H], bias [E] or None, cfg a moe.config.MoEConfig (read by its fields) ->
    topk_ids [T, k] int64, topk_weights [T, k] (moe/gate.py Gate.forward: one call instead of ~15 ops)."""
    check_float32("x", x, 2)
    check_float32("weight", weight, 2)
    (T, H), (E, H2) = x.shape, weight.shape
    k, G = cfg.top_k, cfg.n_group
    if H2 != H or not weight.is_contiguous() or E != cfg.n_routed_experts or not 1 <= k <= E or E % G:
        raise ValueError(f"route: x {tuple(x.shape)} and a contiguous weight {tuple(weight.shape)} with "
                         f"{cfg.n_routed_experts} experts, top-{k}, {G} groups do not fit")
    if bias is not None:
        check_float32("bias", bias, 1)
        if bias.shape[0] != E:
            raise ValueError(f"route: bias has {bias.shape[0]} entries, there are {E} experts")
    x = x if x.is_contiguous() else x.contiguous()
    ids, wts = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    if T:
        logits = torch.empty(T, E)
        library().wd_route(x.data_ptr(), T, H, weight.data_ptr(), E, None if bias is None else bias.data_ptr(),
                           int(cfg.scoring_func == "sigmoid"), _METHODS[cfg.topk_method], G, cfg.topk_group, k,
                           int(cfg.norm_topk_prob), cfg.routed_scaling_factor, logits.data_ptr(),
                           ids.data_ptr(), wts.data_ptr())
    return ids, wts


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


def mlp_layer(h: torch.Tensor, x: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """h, x [T, H] (the residual and the post-attention-normed mlp_in), a dense layer's MLP
    (mlp_layer_weights) -> h + MLP(x) [T, H] in one call (the SwiGLU of the shared experts)."""
    T, H = x.shape
    out = torch.empty(T, H)
    library().wd_mlp_layer(ctypes.byref(w), h.data_ptr(), x.data_ptr(), T, out.data_ptr(),
                           scratch(T * (w.H + 2 * w.Is)).data_ptr())
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
               + [T * (w.H + 2 * w.Is) for w in mlp if w is not None])
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
