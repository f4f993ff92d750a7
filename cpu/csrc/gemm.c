/* The streamed small-batch GEMM (cpu/gemm.py linear, bmm_nt): a decode step multiplies every weight by a
   handful of rows, so it reads each weight row once, front to back, doing all of the row's work while it
   is in L1 (why and measurements: cpu/gemm.py, docs/kernels.md). */
#include "wideep.h"

/* part[j] (16 lanes whose sum is x[j] . wr) for MB rows of x. Two accumulators per row halve the FMA
   dependency chains (one row of x too: its weights then stream ~13 % faster, measured A/B; four
   accumulators stream slower). Features past the last multiple of 16: one zero-padded step. */
#define ROW(MB)                                                                                    \
static inline void row_##MB(const float *x, int64_t ldx, const float *wr, int64_t K, v16 *part) {   \
    v16 a[MB], b[MB];                                                                              \
    for (int j = 0; j < MB; j++) a[j] = b[j] = bc(0);                                              \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    for (; k + 32 <= K16; k += 32) {                                                               \
        v16 w0 = ld(wr + k), w1 = ld(wr + k + 16);                                                 \
        for (int j = 0; j < MB; j++) {                                                             \
            a[j] += w0 * ld(x + j * ldx + k);                                                      \
            b[j] += w1 * ld(x + j * ldx + k + 16);                                                 \
        }                                                                                          \
    }                                                                                              \
    for (; k < K16; k += 16) {                                                                     \
        v16 w0 = ld(wr + k);                                                                       \
        for (int j = 0; j < MB; j++) a[j] += w0 * ld(x + j * ldx + k);                             \
    }                                                                                              \
    if (k < K) {                                                                                   \
        v16 w0 = ld_part(wr + k, K - k);                                                           \
        for (int j = 0; j < MB; j++) a[j] += w0 * ld_part(x + j * ldx + k, K - k);                 \
    }                                                                                              \
    for (int j = 0; j < MB; j++) part[j] = a[j] + b[j];                                            \
}
ROW(1) ROW(2) ROW(4) ROW(8)

/* the partial sums of all m rows of x (m <= MCHUNK) against one row of w, in blocks of 8, 4, 2, 1 */
#define MCHUNK 32
static inline void row_all(const float *x, int64_t ldx, int64_t m, const float *wr, int64_t K, v16 *part) {
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) row_8(x + j * ldx, ldx, wr, K, part + j);
    if (j + 4 <= m) { row_4(x + j * ldx, ldx, wr, K, part + j); j += 4; }
    if (j + 2 <= m) { row_2(x + j * ldx, ldx, wr, K, part + j); j += 2; }
    if (j < m) row_1(x + j * ldx, ldx, wr, K, part + j);
}

/* Four or more rows of x: per weight vector, the single-row form loads a vector of x for every FMA, and
   from 4 rows on those loads, not the weight stream, set the pace (measured on the routed experts: an
   expert with 4 tokens streamed its weights at ~15 GB/s against ~25 with 1-3). Blocks of 4 rows of w x
   MB rows of x share every load (16 accumulators): x is read once per 4 rows of w instead of once per
   row. With many rows the FMAs are the bottleneck, and this is their best form too. */
#define BLOCK4_STEP(MB, LD)                                                                        \
        {                                                                                          \
            v16 w0 = LD(w + k), w1 = LD(w + ldw + k), w2 = LD(w + 2 * ldw + k), w3 = LD(w + 3 * ldw + k); \
            KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3);                                                \
            for (int j = 0; j < MB; j++) {                                                         \
                v16 xv = LD(x + j * ldx + k);                                                      \
                KEEP(xv);                                                                          \
                acc[j][0] += w0 * xv; acc[j][1] += w1 * xv; acc[j][2] += w2 * xv; acc[j][3] += w3 * xv; \
            }                                                                                      \
        }
#define LD_FULL(p) ld(p)
#define LD_TAIL(p) ld_part(p, K - k)
#define BLOCK4(MB)                                                                                 \
static void block4_##MB(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,        \
                        int64_t ldy, int64_t K, int pf) {                                          \
    v16 acc[MB][4];                                                                                \
    for (int j = 0; j < MB; j++) for (int r = 0; r < 4; r++) acc[j][r] = bc(0);                    \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    if (pf)                                                                                        \
        for (; k < K16; k += 16) {                                                                 \
            for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + k, 0, 2);                \
            BLOCK4_STEP(MB, LD_FULL)                                                               \
        }                                                                                          \
    else                                                                                           \
        for (; k < K16; k += 16) BLOCK4_STEP(MB, LD_FULL)                                          \
    if (k < K) BLOCK4_STEP(MB, LD_TAIL)                                                            \
    for (int j = 0; j < MB; j++) {                                                                 \
        v16 s = reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);                               \
        for (int r = 0; r < 4; r++) y[j * ldy + r] = s[4 * r];                                     \
    }                                                                                              \
}
BLOCK4(2) BLOCK4(3) BLOCK4(4)

/* y [M, N] (rows ldy apart) = x [M, K] @ w [N, K]^T. One to three rows of x (memory-bound): the rows of w
   are read once each, front to back (never two at once: two streams read slower than one), and all of
   a row's work is done while it is in L1; four rows' partial sums are reduced together. Four or more
   rows: BLOCK4 (measured A/B on the experts kernel, the same build's 1-row case as the control: 4 rows
   0.71-0.83x the time, 6-7 rows 0.63-0.80x, 5 rows as 3 + 2 even, 9 and 13 rows 0.91-0.95x). */
void linear(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int64_t M, int64_t N,
            int64_t K) {
    v16 part[4][MCHUNK];
    int64_t n4 = N & ~(int64_t)3;
    if (M >= 4) {
        for (int64_t n = 0; n < n4; n += 4)
            for (int64_t m = 0; m < M;) {
                /* blocks of 4 rows of x; five left: 3 + 2 (a block of one reads 4 weight rows for 4 FMAs) */
                int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
                const float *xm = x + m * ldx, *wn = w + n * ldw;
                float *ym = y + m * ldy + n;
                switch (mb) {
                    case 2: block4_2(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    case 3: block4_3(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    default: block4_4(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N);
                }
                m += mb;
            }
    } else {
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) row_all(x, ldx, M, w + (n + r) * ldw, K, part[r]);
            for (int64_t j = 0; j < M; j++) {
                v16 s = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = s[4 * r];
            }
        }
    }
    for (int64_t n = n4; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            int64_t m = M - m0 < MCHUNK ? M - m0 : MCHUNK;
            row_all(x + m0 * ldx, ldx, m, w + n * ldw, K, part[0]);
            for (int64_t j = 0; j < m; j++) {
                float t = 0;
                for (int l = 0; l < 16; l++) t += part[0][j][l];
                y[(m0 + j) * ldy + n] = t;
            }
        }
}

void bmm_nt(int64_t B, const float *x, int64_t sxb, int64_t ldx, const float *w, int64_t swb, int64_t ldw,
            float *y, int64_t syb, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    for (int64_t b = 0; b < B; b++) linear(x + b * sxb, ldx, w + b * swb, ldw, y + b * syb, ldy, M, N, K);
}

void wd_bmm_nt(const wd_bmm_nt_args *a) {
    bmm_nt(a->B, a->x, a->sxb, a->ldx, a->w, a->swb, a->ldw, a->y, a->syb, a->ldy, a->M, a->N, a->K);
}
