/* The routed experts (cpu/gemm.py experts) and the SwiGLU MLP of shared experts and dense layers
   (cpu/fused.py), on the streamed GEMM. */
#include "wideep.h"

/* The first PREFETCH_HEAD floats (8 KiB) of a matrix the caller reads next, asked into L2 while it
   finishes the current one: the hardware prefetcher restarts at every new matrix, ~100 a layer in a
   decode step's experts (measured: the decode benchmark's step ~2.5 % faster, an in-process A/B of
   the two builds, 6 rounds; in the experts alone 2 or 16 KiB gained less). */
#define PREFETCH_HEAD 2048
static inline void prefetch_head(const float *w, int64_t n) {
    for (int64_t i = 0; i < PREFETCH_HEAD && i < n; i += 16) __builtin_prefetch(w + i, 0, 2);
}

/* Routed experts. ids [T, k] local expert ids (-1: on another rank), wts [T, k]. The (token, slot)
   pairs are counting-sorted by expert (stable: the reference's order); per expert with tokens: gather
   them, h = x @ w13[e]^T, a = silu(gate) * up, y = a @ w2[e]^T, out[token] += weight * y.
   iscratch: 2 * (El + 1) + T * k ints; scratch: T * (2H + 3I) floats. Returns 0, or -1 - p for the
   first pair p whose id is >= El (nothing is computed then). */
int64_t experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t El, const float *w13, const float *w2,
                const int64_t *ids, const float *wts, int64_t k, float *out, int64_t *iscratch, float *scratch) {
    int64_t P = T * k, *start = iscratch, *fill = start + El + 1, *order = fill + El + 1;
    memset(start, 0, (El + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] >= El) return -1 - p;
        if (ids[p] >= 0) start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < El; e++) start[e + 1] += start[e];
    memcpy(fill, start, El * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0) order[fill[ids[p]]++] = p;
    for (int64_t e = 0; e < El; e++) {
        int64_t p0 = start[e], np = start[e + 1] - p0;
        if (!np) continue;
        float *xs = scratch, *h = xs + np * H, *a = h + np * 2 * I, *y = a + np * I;
        for (int64_t p = 0; p < np; p++) memcpy(xs + p * H, x + order[p0 + p] / k * H, H * sizeof(float));
        prefetch_head(w2 + e * H * I, H * I);
        linear(xs, H, w13 + e * 2 * I * H, H, h, 2 * I, np, 2 * I, H);
        for (int64_t p = 0; p < np; p++) {
            const float *g = h + p * 2 * I, *u = g + I;
            float *ap = a + p * I;
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                v16 gv = ld(g + i);
                st(ap + i, gv / (bc(1.0f) + vexp(-gv)) * ld(u + i));
            }
            for (; i < I; i++) ap[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        int64_t next = e + 1;
        while (next < El && start[next + 1] == start[next]) next++;
        if (next < El) prefetch_head(w13 + next * 2 * I * H, 2 * I * H);
        linear(a, I, w2 + e * H * I, I, y, H, np, H, I);
        for (int64_t p = 0; p < np; p++) {
            float wt = wts[order[p0 + p]], *o = out + order[p0 + p] / k * H;
            for (int64_t c = 0; c < H; c++) o[c] += wt * y[p * H + c];
        }
    }
    return 0;
}

int64_t wd_experts(const wd_experts_args *a) {
    return experts(a->x, a->T, a->H, a->I, a->El, a->w13, a->w2, a->ids, a->wts, a->k, a->out, a->iscratch,
                   a->scratch);
}

/* y [T, H] = sd @ (silu(sg @ x) * (su @ x)) for x [T, H], sg, su [Is, H], sd [H, Is] (layers/mlp.py MLP). scratch:
   2 T Is floats. */
void swiglu(const float *x, int64_t T, int64_t H, const float *sg, const float *su, const float *sd, int64_t Is,
            float *y, float *scratch) {
    float *g = scratch, *u = g + T * Is;
    linear(x, H, sg, H, g, Is, T, Is, H);
    linear(x, H, su, H, u, Is, T, Is, H);
    for (int64_t i = 0; i < T * Is; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    linear(g, Is, sd, Is, y, H, T, H, Is);
}
