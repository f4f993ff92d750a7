/* The routed experts (cpu/gemm.py experts) and the SwiGLU MLP of shared experts and dense layers
   (cpu/fused.py), on the streamed GEMM. */
#include "wideep.h"

/* The first PREFETCH_HEAD floats (8 KiB) of a matrix the caller reads next, asked into L2 while it
   finishes the current one: the hardware prefetcher restarts at every new matrix, ~100 a layer in a
   decode step's experts (measured: the decode benchmark's step ~2.5 % faster, an in-process A/B of
   the two builds, 6 rounds; in the experts alone 2 or 16 KiB gained less). */
#define PREFETCH_HEAD 2048
static inline void prefetch_head(const void *w, int64_t bytes) {
    for (int64_t i = 0; i < PREFETCH_HEAD * 4 && i < bytes; i += 64) __builtin_prefetch((const char *)w + i, 0, 2);
}

/* min(v, hi) and max(v, lo) per lane (the clamped SwiGLU) */
static inline v16 vmin(v16 v, v16 hi) { i16 m = v < hi; return (v16)(((i16)v & m) | ((i16)hi & ~m)); }
static inline v16 vmax(v16 v, v16 lo) { i16 m = v > lo; return (v16)(((i16)v & m) | ((i16)lo & ~m)); }

/* a [np, I] = silu(gate) * up of h [np, 2I] (gate's columns, then up's); limit > 0: gate clamped to <= limit
   and up to [-limit, limit] first (moe/experts.py Experts._act) */
static void swiglu_rows(const float *h, int64_t np, int64_t I, float limit, float *a) {
    for (int64_t p = 0; p < np; p++) {
        const float *g = h + p * 2 * I, *u = g + I;
        float *ap = a + p * I;
        int64_t i = 0;
        if (limit > 0) {
            v16 hi = bc(limit), lo = bc(-limit);
            for (; i + 16 <= I; i += 16) {
                v16 gv = vmin(ld(g + i), hi);
                st(ap + i, gv / (bc(1.0f) + vexp(-gv)) * vmax(vmin(ld(u + i), hi), lo));
            }
            for (; i < I; i++) {
                float gs = g[i] < limit ? g[i] : limit, us = u[i] < limit ? (u[i] > -limit ? u[i] : -limit) : limit;
                ap[i] = gs / (1.0f + expf(-gs)) * us;
            }
            continue;
        }
        for (; i + 16 <= I; i += 16) {
            v16 gv = ld(g + i);
            st(ap + i, gv / (bc(1.0f) + vexp(-gv)) * ld(u + i));
        }
        for (; i < I; i++) ap[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* xs [np, H] = rows order[p0 ..] / k of x (float32, or bfloat16 widened: xdt) */
static void gather_rows(const void *x, int64_t xdt, int64_t H, const int64_t *order, int64_t np, int64_t k, float *xs) {
    int64_t esz = xdt == WD_BF16 ? 2 : 4;
    for (int64_t p = 0; p < np; p++) row_f32((const char *)x + order[p] / k * H * esz, xdt, H, xs + p * H);
}

/* Routed experts. x [T, H] float32 or bfloat16 (xdt); ids [T, k] local expert ids (-1: on another rank), wts
   [T, k]. The (token, slot) pairs are counting-sorted by expert (stable: the reference's order); per expert with
   tokens: gather them (on AMX tiles, bfloat16 weights: expert_amx, the whole expert in one pass), h = x @ w13[e]^T,
   a = silu(gate) * up (clamped when limit > 0), y = a @ w2[e]^T, out[token] += weight * y. iscratch: 2 * (El + 1)
   + T * k ints; scratch: T * (2H + 3I) floats (WD_FP4: and FP4_XP(T * k, max(H, I)) more, x permuted for
   linear_fp4; T * k bounds an expert's pairs). w13, w2 of dtype wdt
   (WD_FP8: with their block scales s13, s2, read in place by linear_fp8; WD_FP4: e2m1 pairs with their e8m0
   scales, read in place by linear_fp4). Returns 0, or -1 - p for the first pair p whose id is >= El
   (nothing is computed then). */
int64_t experts(const void *x, int64_t xdt, int64_t T, int64_t H, int64_t I, int64_t El, const void *w13,
                const void *w2, int64_t wdt, const void *s13, const void *s2, int64_t br, int64_t bk, const int64_t *ids,
                const float *wts, int64_t k, float *out, int64_t *iscratch, float *scratch, float limit) {
    int64_t P = T * k, *start = iscratch, *fill = start + El + 1, *order = fill + El + 1;
    /* bytes of one expert's w13 and w2 */
    int64_t b13 = wdt == WD_FP4 ? I * H : 2 * I * H * (wdt == WD_FP8 ? 1 : wdt == WD_BF16 ? 2 : 4);
    int64_t b2 = b13 / 2;
    /* fp8: per expert, gate's scale rows then up's ([2 Ib, Hb]), and down's [Hb, Ib] */
    int64_t Ib = wdt == WD_FP8 ? (I + br - 1) / br : 0, Hb = wdt == WD_FP8 ? (H + br - 1) / br : 0;
    int64_t Hk = wdt == WD_FP8 ? (H + bk - 1) / bk : 0, Ik = wdt == WD_FP8 ? (I + bk - 1) / bk : 0;
    const char *w13b = w13, *w2b = w2;
    memset(start, 0, (El + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] >= El) return -1 - p;
        if (ids[p] >= 0) start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < El; e++) start[e + 1] += start[e];
    memcpy(fill, start, El * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0) order[fill[ids[p]]++] = p;
    /* bfloat16 weights on AMX tiles, both GEMMs whole tiles (H, I multiples of 32): each expert in one call of
       experts_amx.c (its rows of x read in place, nothing in between the GEMMs) */
    int tiles = wdt == WD_BF16 && bf16_dot() && amx_on() && H % 32 == 0 && I % 32 == 0;
    for (int64_t e = 0; e < El; e++) {
        int64_t p0 = start[e], np = start[e + 1] - p0;
        if (!np) continue;
        float *xs = scratch, *h = xs + np * H, *a = h + np * 2 * I, *y = a + np * I, *xp = scratch + T * (2 * H + 3 * I);
        if (tiles) {   /* the rows' ids in xs's room (np <= np * H / 2 of them), their weights in h's */
            int64_t *rows = (int64_t *)xs;
            for (int64_t p = 0; p < np; p++) {
                rows[p] = order[p0 + p] / k;
                h[p] = wts[order[p0 + p]];
            }
            int64_t nx = e + 1;
            while (nx < El && start[nx + 1] == start[nx]) nx++;
            if (expert_amx(x, xdt, rows, h, np, H, I, (const uint16_t *)(w13b + e * b13),
                           (const uint16_t *)(w2b + e * b2), nx < El ? (const uint16_t *)(w13b + nx * b13) : NULL,
                           limit, out))
                continue;
        }
        gather_rows(x, xdt, H, order + p0, np, k, xs);
        prefetch_head(w2b + e * b2, b2);
        if (wdt == WD_FP8) {   /* gate and up are quantised apart: their blocks restart at row I */
            const uint8_t *we = (const uint8_t *)w13b + e * 2 * I * H;
            const float *se = (const float *)s13 + e * 2 * Ib * Hk;
            linear_fp8(xs, H, we, H, se, Hk, br, bk, h, 2 * I, np, I, H);
            linear_fp8(xs, H, we + I * H, H, se + Ib * Hk, Hk, br, bk, h + I, 2 * I, np, I, H);
        } else if (wdt == WD_FP4) {
            linear_fp4(xs, H, (const uint8_t *)w13b + e * b13, H / 2, (const uint8_t *)s13 + e * 2 * I * (H / 32),
                       H / 32, h, 2 * I, np, 2 * I, H, xp);
        } else {
            linear_w(xs, H, w13b + e * b13, wdt, H, h, 2 * I, np, 2 * I, H);
        }
        swiglu_rows(h, np, I, limit, a);
        int64_t next = e + 1;
        while (next < El && start[next + 1] == start[next]) next++;
        if (next < El) prefetch_head(w13b + next * b13, b13);
        if (wdt == WD_FP8)
            linear_fp8(a, I, (const uint8_t *)w2b + e * H * I, I, (const float *)s2 + e * Hb * Ik, Ik, br, bk, y, H,
                       np, H, I);
        else if (wdt == WD_FP4)
            linear_fp4(a, I, (const uint8_t *)w2b + e * b2, I / 2, (const uint8_t *)s2 + e * H * (I / 32), I / 32,
                       y, H, np, H, I, xp);
        else
            linear_w(a, I, w2b + e * b2, wdt, I, y, H, np, H, I);
        for (int64_t p = 0; p < np; p++) {
            float wt = wts[order[p0 + p]], *o = out + order[p0 + p] / k * H;
            for (int64_t c = 0; c < H; c++) o[c] += wt * y[p * H + c];
        }
    }
    return 0;
}

int64_t wd_experts(const wd_experts_args *a) {
    if (a->wdt == WD_FP8 && (a->br <= 0 || a->bk <= 0 || a->bk % 16 || !a->s13 || !a->s2)) return INT64_MIN;
    if (a->wdt == WD_FP4 && (a->H % 32 || a->I % 32 || !a->s13 || !a->s2)) return INT64_MIN;
    return experts(a->x, a->xdt, a->T, a->H, a->I, a->El, a->w13, a->w2, a->wdt, a->s13, a->s2, a->br, a->bk, a->ids,
                   a->wts, a->k, a->out, a->iscratch, a->scratch, a->limit);
}

/* y [T, H] = sd @ (silu(sg @ x) * (su @ x)) for x [T, H], sg, su [Is, H], sd [H, Is] (layers/mlp.py MLP), of
   dtype wdt. scratch: 2 T Is floats. */
void swiglu(const float *x, int64_t T, int64_t H, const void *sg, const void *su, const void *sd, int64_t wdt,
            int64_t Is, float *y, float *scratch) {
    float *g = scratch, *u = g + T * Is;
    if (wdt == WD_BF16) amx_next(su, H, Is, H);
    linear_w(x, H, sg, wdt, H, g, Is, T, Is, H);
    if (wdt == WD_BF16) amx_next(sd, Is, H, Is);
    linear_w(x, H, su, wdt, H, u, Is, T, Is, H);
    int64_t i = 0;   /* 16 lanes at a time, as the routed experts' (measured, 16 tokens, Is 256, H 512, median of 40:
                        0.34 -> 0.28 ms on float32 weights, 0.24 -> 0.19 on bfloat16; noisy machine) */
    for (; i + 16 <= T * Is; i += 16) {
        v16 gv = ld(g + i);
        st(g + i, gv / (bc(1.0f) + vexp(-gv)) * ld(u + i));
    }
    for (; i < T * Is; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    linear_w(g, Is, sd, wdt, Is, y, H, T, H, Is);
}
