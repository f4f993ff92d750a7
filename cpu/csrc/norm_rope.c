/* RMSNorm and the rotary embedding (cpu/layers.py rmsnorm, rope): one pass instead of six or ten torch ops. */
#include <stdlib.h>

#include "wideep.h"

/* y [M, N] = w * x * rsqrt(mean(x^2) + eps) per row (rows ldx / ldy apart; w float32 or, wdt WD_BF16, bfloat16) */
void rmsnorm(const float *x, int64_t ldx, const void *wv, int64_t wdt, float *y, int64_t ldy, int64_t M, int64_t N,
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
        if (wdt == WD_BF16) {
            const uint16_t *w = wv;
            for (int64_t n = 0; n < N16; n += 16) st(yr + n, ld_bf16(w + n) * (ld(xr + n) * r));
        } else {
            const float *w = wv;
            for (int64_t n = 0; n < N16; n += 16) st(yr + n, ld(w + n) * (ld(xr + n) * r));
        }
        for (int64_t n = N16; n < N; n++) yr[n] = wget(wv, wdt, n) * (xr[n] * r[0]);
    }
}

/* Rotary embedding: x [T, Hh, R] (strides sxt, sxh; unit last) -> y [T, Hh, R] contiguous, cos/sin
   [T, R/2] contiguous. interleave: pairs (x[2i], x[2i+1]); else halves (x[i], x[i + R/2]). */
void rope(const float *x, int64_t T, int64_t Hh, int64_t R, int64_t sxt, int64_t sxh, const float *cos,
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

/* n float32 values f into p (float32, or bfloat16 rounded to nearest even: dt) */
static void from_f32(const float *f, int64_t n, int64_t dt, void *p) {
    if (dt != WD_BF16) {
        memcpy(p, f, n * sizeof(float));
        return;
    }
    uint16_t *b = p;
    for (int64_t i = 0; i < n; i++) b[i] = to_bf16(f[i]);
}

/* bfloat16 in or out: a row (rmsnorm) or a token's heads (rope) at a time through float32 copies, so that the
   kernels' float32 loops are the only arithmetic (a bfloat16 model's activations need no torch conversions) */
int64_t wd_rmsnorm(const wd_rmsnorm_args *a) {
    if (a->xdt != WD_BF16 && a->ydt != WD_BF16) {
        rmsnorm(a->x, a->ldx, a->w, a->wdt, a->y, a->ldy, a->M, a->N, a->eps);
        return 0;
    }
    float *buf = malloc((size_t)(2 * a->N) * sizeof(float));
    if (!buf) return -1;
    int64_t xs = a->xdt == WD_BF16 ? 2 : 4, ys = a->ydt == WD_BF16 ? 2 : 4;
    for (int64_t m = 0; m < a->M; m++) {
        row_f32((const char *)a->x + m * a->ldx * xs, a->xdt, a->N, buf);
        rmsnorm(buf, a->N, a->w, a->wdt, buf + a->N, a->N, 1, a->N, a->eps);
        from_f32(buf + a->N, a->N, a->ydt, (char *)a->y + m * a->ldy * ys);
    }
    free(buf);
    return 0;
}

int64_t wd_rope(const wd_rope_args *a) {
    if (a->xdt != WD_BF16 && a->ydt != WD_BF16) {
        rope(a->x, a->T, a->Hh, a->R, a->sxt, a->sxh, a->cos, a->sin, a->y, (int)a->interleave);
        return 0;
    }
    int64_t n = a->Hh * a->R, h2 = a->R / 2, xs = a->xdt == WD_BF16 ? 2 : 4, ys = a->ydt == WD_BF16 ? 2 : 4;
    float *buf = malloc((size_t)(2 * n) * sizeof(float));
    if (!buf) return -1;
    for (int64_t t = 0; t < a->T; t++) {
        for (int64_t h = 0; h < a->Hh; h++)
            row_f32((const char *)a->x + (t * a->sxt + h * a->sxh) * xs, a->xdt, a->R, buf + h * a->R);
        rope(buf, 1, a->Hh, a->R, n, a->R, (const float *)a->cos + t * h2, (const float *)a->sin + t * h2, buf + n,
             (int)a->interleave);
        from_f32(buf + n, n, a->ydt, (char *)a->y + t * n * ys);
    }
    free(buf);
    return 0;
}
