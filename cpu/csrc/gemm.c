/* The streamed small-batch GEMM (cpu/gemm.py linear, bmm_nt): a decode step multiplies every weight by a
   handful of rows, so it reads each weight row once, front to back, doing all of the row's work while it
   is in L1 (why and measurements: cpu/gemm.py, docs/kernels.md). The loops are in gemm_tpl.h, made here
   for float32 weights (linear) and for bfloat16 weights widened to float32 as they are loaded
   (linear_bf16cvt: the path for CPUs without AVX512-BF16; gemm_bf16dp.c has the one with it).

   One to three rows of x (memory-bound): the rows of w are read once each, front to back (never two at
   once: two streams read slower than one), and all of a row's work is done while it is in L1; four rows'
   partial sums are reduced together. Four or more rows: per weight vector, the single-row form loads a
   vector of x for every FMA, and from 4 rows on those loads, not the weight stream, set the pace
   (measured on the routed experts: an expert with 4 tokens streamed its weights at ~15 GB/s against ~25
   with 1-3). Blocks of 4 rows of w x MB rows of x share every load (16 accumulators): x is read once per
   4 rows of w instead of once per row (measured A/B on the experts kernel, the same build's 1-row case
   as the control: 4 rows 0.71-0.83x the time, 6-7 rows 0.63-0.80x, 5 rows as 3 + 2 even, 9 and 13 rows
   0.91-0.95x). With many rows the FMAs are the bottleneck, and this is their best form too. */
#include <stdlib.h>

#include "wideep.h"

#define MCHUNK 32

#if WD_AVX2   /* 8-float vectors instead (gemm_avx2.c): 16-float ones spill without AVX-512 */
#define linear_f32 linear_f32_avx2
#define linear_bf16cvt linear_bf16cvt_avx2
#else
#define WT float
#define LDW(p) ld(p)
#define LDW_PART(p, n) ld_part(p, n)
#define SFX(name) name##_f32
#include "gemm_tpl.h"
#undef WT
#undef LDW
#undef LDW_PART
#undef SFX

#define WT uint16_t
#define LDW(p) ld_bf16(p)
#define LDW_PART(p, n) ld_bf16_part(p, n)
#define SFX(name) name##_bf16cvt
#include "gemm_tpl.h"
#undef WT
#undef LDW
#undef LDW_PART
#undef SFX
#endif

void linear(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int64_t M, int64_t N,
            int64_t K) {
    linear_f32(x, ldx, w, ldw, y, ldy, M, N, K);
}

/* From this many rows of x bfloat16 weights go to the AMX tiles where they are on (gemm_amx.c) */
#define AMX_MIN_ROWS 1

void linear_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K) {
#if WD_BF16DP
    if (bf16_dot()) {
        if (M >= AMX_MIN_ROWS && amx_on() && linear_amx(x, ldx, w, ldw, y, ldy, M, N, K)) return;
        linear_bf16dp(x, ldx, w, ldw, y, ldy, M, N, K);
        return;
    }
#endif
    linear_bf16cvt(x, ldx, w, ldw, y, ldy, M, N, K);
}

void linear_w(const float *x, int64_t ldx, const void *w, int64_t wdt, int64_t ldw, float *y, int64_t ldy, int64_t M,
              int64_t N, int64_t K) {
    if (wdt == WD_BF16) {
        linear_bf16(x, ldx, (const uint16_t *)w, ldw, y, ldy, M, N, K);
    } else if (wdt == WD_FP8) {
        const wd_fp8_mat *m = w;
        linear_fp8(x, ldx, m->q, ldw, m->s, m->lds, m->br, m->bk, y, ldy, M, N, K);
    } else {
        linear_f32(x, ldx, (const float *)w, ldw, y, ldy, M, N, K);
    }
}

void bmm_nt(int64_t B, const float *x, int64_t sxb, int64_t ldx, const void *w, int64_t wdt, int64_t swb, int64_t ldw,
            float *y, int64_t syb, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t esz = wdt == WD_BF16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++) {
        if (wdt == WD_BF16 && b + 1 < B) amx_next((const char *)w + (b + 1) * swb * esz, ldw, N, K);
        linear_w(x + b * sxb, ldx, (const char *)w + b * swb * esz, wdt, ldw, y + b * syb, ldy, M, N, K);
    }
}

int64_t wd_bmm_nt(const wd_bmm_nt_args *a) {
    if (a->xdt != WD_BF16) {
        bmm_nt(a->B, a->x, a->sxb, a->ldx, a->w, a->wdt, a->swb, a->ldw, a->y, a->syb, a->ldy, a->M, a->N, a->K);
        return 0;
    }
    /* bfloat16 activations: read as they are by the tiles; else widened (exactly) a batch at a time */
    int tiles = a->wdt == WD_BF16 && bf16_dot() && amx_on();
    int64_t esz = a->wdt == WD_BF16 ? 2 : 4;
    float *xf = NULL;
    for (int64_t b = 0; b < a->B; b++) {
        const uint16_t *xb = (const uint16_t *)a->x + b * a->sxb;
        const void *wb = (const char *)a->w + b * a->swb * esz;
        float *yb = a->y + b * a->syb;
        if (tiles && b + 1 < a->B) amx_next((const char *)wb + a->swb * esz, a->ldw, a->N, a->K);
        if (tiles && linear_amx_rows(xb, WD_BF16, a->ldx, NULL, wb, a->ldw, yb, a->ldy, a->M, a->N, a->K)) continue;
        if (!xf && !(xf = malloc((size_t)(a->M * a->K) * sizeof(float)))) return -1;
        for (int64_t m = 0; m < a->M; m++) row_f32(xb + m * a->ldx, WD_BF16, a->K, xf + m * a->K);
        linear_w(xf, a->K, wb, a->wdt, a->ldw, yb, a->ldy, a->M, a->N, a->K);
    }
    free(xf);
    return 0;
}
