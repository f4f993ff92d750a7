/* DeepSeek-V4's hyper-connections (layers/hyper_connection.py): a block's entry (the streams' RMS-normalised mix
   through fn, the pre / post / comb weights with comb's Sinkhorn iterations, the streams collapsed by pre) and its
   exit (post * out + comb^T streams), a token at a time in float32: in torch each is ~80 small operations, most of a
   decode step's time on a small batch. */
#include <math.h>
#include <stdlib.h>

#include "wideep.h"

static inline float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* dot(a, b) over n floats, four accumulators */
static float dot(const float *a, const float *b, int64_t n) {
    v16 s0 = bc(0), s1 = bc(0), s2 = bc(0), s3 = bc(0);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 += ld(a + i) * ld(b + i); s1 += ld(a + i + 16) * ld(b + i + 16);
        s2 += ld(a + i + 32) * ld(b + i + 32); s3 += ld(a + i + 48) * ld(b + i + 48);
    }
    for (; i + 16 <= n; i += 16) s0 += ld(a + i) * ld(b + i);
    if (i < n) s0 += ld_part(a + i, n - i) * ld_part(b + i, n - i);
    v16 s = (s0 + s1) + (s2 + s3);
    float r = 0;
    for (int l = 0; l < 16; l++) r += s[l];
    return r;
}

int64_t wd_hc_enter(const wd_hc_enter_args *a) {
    const int64_t T = a->T, n = a->n, H = a->H, K = n * H, J = a->head ? n : (2 + n) * n;
    const int64_t xs = a->xdt == WD_BF16 ? 2 : 4, ys = a->ydt == WD_BF16 ? 2 : 4;
    float *xf = malloc((size_t)(T * K + T * J + H) * sizeof(float));
    if (!xf) return -1;
    float *mix = xf + T * K, *yrow = mix + T * J;
    for (int64_t t = 0; t < T; t++) row_f32((const char *)a->x + t * K * xs, a->xdt, K, xf + t * K);
    for (int64_t j = 0; j < J; j++)   /* fn's row j stays in cache while the tokens pass */
        for (int64_t t = 0; t < T; t++) mix[t * J + j] = dot(a->fn + j * K, xf + t * K, K);
    for (int64_t t = 0; t < T; t++) {
        const float *x = xf + t * K;
        float *m = mix + t * J, *pre = a->pre + t * n;
        float ss = dot(x, x, K);
        float r = 1.0f / sqrtf(ss / K + a->norm_eps);
        for (int64_t k = 0; k < n; k++) pre[k] = sigm(m[k] * r * a->scale[0] + a->base[k]) + a->eps;
        if (!a->head) {
            float *post = a->post + t * n, *c = a->comb + t * n * n;
            for (int64_t k = 0; k < n; k++) post[k] = 2.0f * sigm(m[n + k] * r * a->scale[1] + a->base[n + k]);
            for (int64_t i = 0; i < n; i++) {   /* softmax of each row, + eps */
                float mx = -INFINITY, s = 0;
                for (int64_t k = 0; k < n; k++) {
                    c[i * n + k] = m[2 * n + i * n + k] * r * a->scale[2] + a->base[2 * n + i * n + k];
                    mx = fmaxf(mx, c[i * n + k]);
                }
                for (int64_t k = 0; k < n; k++) { c[i * n + k] = expf(c[i * n + k] - mx); s += c[i * n + k]; }
                for (int64_t k = 0; k < n; k++) c[i * n + k] = c[i * n + k] / s + a->eps;
            }
            for (int64_t it = 0; it < (a->iters > 1 ? a->iters : 1); it++) {   /* columns, then (after the first) rows and columns */
                if (it > 0)
                    for (int64_t i = 0; i < n; i++) {
                        float s = 0;
                        for (int64_t k = 0; k < n; k++) s += c[i * n + k];
                        for (int64_t k = 0; k < n; k++) c[i * n + k] /= s + a->eps;
                    }
                for (int64_t k = 0; k < n; k++) {
                    float s = 0;
                    for (int64_t i = 0; i < n; i++) s += c[i * n + k];
                    for (int64_t i = 0; i < n; i++) c[i * n + k] /= s + a->eps;
                }
            }
        }
        /* y = sum_k pre_k x_k */
        for (int64_t h = 0; h < H; h++) yrow[h] = 0;
        for (int64_t k = 0; k < n; k++) {
            const float *xk = x + k * H;
            v16 p = bc(pre[k]);
            int64_t h = 0;
            for (; h + 16 <= H; h += 16) st(yrow + h, ld(yrow + h) + p * ld(xk + h));
            for (; h < H; h++) yrow[h] += pre[k] * xk[h];
        }
        char *y = (char *)a->y + t * H * ys;
        if (a->ydt == WD_BF16)
            for (int64_t h = 0; h < H; h++) ((uint16_t *)y)[h] = to_bf16(yrow[h]);
        else
            memcpy(y, yrow, H * sizeof(float));
    }
    free(xf);
    return 0;
}

int64_t wd_hc_leave(const wd_hc_leave_args *a) {
    const int64_t T = a->T, n = a->n, H = a->H;
    const int64_t xs = a->xdt == WD_BF16 ? 2 : 4, os = a->odt == WD_BF16 ? 2 : 4;
    float *buf = malloc((size_t)((n + 2) * H) * sizeof(float));
    if (!buf) return -1;
    float *o = buf + n * H, *acc = o + H;
    for (int64_t t = 0; t < T; t++) {
        const float *post = a->post + t * n, *c = a->comb + t * n * n;
        row_f32((const char *)a->x + t * n * H * xs, a->xdt, n * H, buf);
        row_f32((const char *)a->out + t * H * os, a->odt, H, o);
        for (int64_t k = 0; k < n; k++) {
            v16 p = bc(post[k]);
            int64_t h = 0;
            for (; h + 16 <= H; h += 16) st(acc + h, p * ld(o + h));
            for (; h < H; h++) acc[h] = post[k] * o[h];
            for (int64_t j = 0; j < n; j++) {
                v16 w = bc(c[j * n + k]);
                const float *xj = buf + j * H;
                for (h = 0; h + 16 <= H; h += 16) st(acc + h, ld(acc + h) + w * ld(xj + h));
                for (; h < H; h++) acc[h] += c[j * n + k] * xj[h];
            }
            char *y = (char *)a->y + (t * n + k) * H * xs;
            if (a->xdt == WD_BF16)
                for (h = 0; h < H; h++) ((uint16_t *)y)[h] = to_bf16(acc[h]);
            else
                memcpy(y, acc, H * sizeof(float));
        }
    }
    free(buf);
    return 0;
}
