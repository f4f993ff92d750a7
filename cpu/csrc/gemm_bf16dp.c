/* The GEMM for bfloat16 weights on AVX512-BF16 (cpu/gemm.py): vdpbf16ps multiplies 32 bfloat16 pairs and
   adds them, two by two, into 16 float32 lanes, so one instruction does the work of two float32 FMAs and
   a 64-byte weight load feeds 32 products instead of 16. x [M, K] float32 is rounded to bfloat16 once per
   call (to nearest even, into this thread's buffer, rows padded with zeros to a multiple of 32); w and x
   are both row major along K, so their pairs line up with no repacking. Sums stay float32.

   This file is compiled with the instructions enabled per function (target attribute), whatever -march
   says, and gemm.c calls it only when bf16_dot() is on: the CPU has them (checked at run time) and no
   one turned them off (wd_bf16_dot; tests run both paths). Shapes as gemm.c's: one to three rows of x
   read each weight row once, front to back; four or more go in blocks of 4 weight rows x up to 4 rows
   of x, x in chunks of MC rows so that a chunk's bfloat16 copy stays in L2 while the weights stream. */
#include <stdlib.h>

#include "wideep.h"

#if WD_BF16DP
#include <cpuid.h>
#include <immintrin.h>

#define DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MC 64

static __thread uint16_t *xbuf;
static __thread int64_t xcap;

static inline DP __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
static inline DP __mmask32 mask32(int64_t n) { return n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1); }

/* x [M, K] (rows ldx apart) -> bfloat16 rows ldb (>= K, a multiple of 32) apart, zero-padded; NULL when out
   of memory */
static DP const uint16_t *x_to_bf16(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t ldb) {
    if (M * ldb > xcap) {
        free(xbuf);
        xcap = M * ldb;
        xbuf = aligned_alloc(64, (size_t)((xcap * 2 + 63) & ~(int64_t)63));
        if (!xbuf) { xcap = 0; return NULL; }
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < ldb; k += 32) {
            __m512 lo = _mm512_maskz_loadu_ps(mask16(K - k), x + m * ldx + k);
            __m512 hi = _mm512_maskz_loadu_ps(mask16(K - k - 16), x + m * ldx + k + 16);
            _mm512_storeu_si512(xbuf + m * ldb + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    return xbuf;
}

static inline DP __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* part[j] (16 lanes whose sum is x[j] . wr) for MB (1-3) rows of x: one weight row, two accumulators a row
   (two dependency chains) */
#define DPROW(MB)                                                                                  \
static DP void dprow_##MB(const uint16_t *xb, int64_t ldb, const uint16_t *wr, int64_t K, v16 *part) { \
    __m512 a[MB], b[MB];                                                                           \
    for (int j = 0; j < MB; j++) a[j] = b[j] = _mm512_setzero_ps();                                \
    int64_t k = 0, K32 = K & ~(int64_t)31;                                                         \
    for (; k + 64 <= K32; k += 64) {                                                               \
        __m512i w0 = _mm512_loadu_si512(wr + k), w1 = _mm512_loadu_si512(wr + k + 32);             \
        for (int j = 0; j < MB; j++) {                                                             \
            a[j] = dot(a[j], _mm512_loadu_si512(xb + j * ldb + k), w0);                            \
            b[j] = dot(b[j], _mm512_loadu_si512(xb + j * ldb + k + 32), w1);                       \
        }                                                                                          \
    }                                                                                              \
    for (; k < K; k += 32) {                                                                       \
        __m512i w0 = _mm512_maskz_loadu_epi16(mask32(K - k), wr + k);                              \
        for (int j = 0; j < MB; j++) a[j] = dot(a[j], _mm512_loadu_si512(xb + j * ldb + k), w0);   \
    }                                                                                              \
    for (int j = 0; j < MB; j++) part[j] = (v16)_mm512_add_ps(a[j], b[j]);                         \
}
DPROW(1) DPROW(2) DPROW(3)

/* y[j, r] for NW (1 or 4) rows of w x MB (1-4) rows of x: every load shared by the NW x MB accumulators */
#define DPBLOCK(NW, MB)                                                                            \
static DP void dp_##NW##_##MB(const uint16_t *xb, int64_t ldb, const uint16_t *w, int64_t ldw, float *y, \
                              int64_t ldy, int64_t K) {                                            \
    __m512 acc[MB][NW];                                                                            \
    for (int j = 0; j < MB; j++) for (int r = 0; r < NW; r++) acc[j][r] = _mm512_setzero_ps();     \
    for (int64_t k = 0; k < K; k += 32) {                                                          \
        __mmask32 mk = mask32(K - k);                                                              \
        __m512i wv[NW];                                                                            \
        for (int r = 0; r < NW; r++) wv[r] = _mm512_maskz_loadu_epi16(mk, w + r * ldw + k);         \
        for (int j = 0; j < MB; j++) {                                                             \
            __m512i xv = _mm512_loadu_si512(xb + j * ldb + k);                                     \
            for (int r = 0; r < NW; r++) acc[j][r] = dot(acc[j][r], xv, wv[r]);                    \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < MB; j++) {                                                                 \
        if (NW == 4) {                                                                             \
            v16 s = reduce4((v16)acc[j][0], (v16)acc[j][NW > 1], (v16)acc[j][NW > 2 ? 2 : 0],      \
                            (v16)acc[j][NW > 3 ? 3 : 0]);                                          \
            for (int r = 0; r < NW; r++) y[j * ldy + r] = s[4 * r];                                \
        } else {                                                                                   \
            y[j * ldy] = _mm512_reduce_add_ps(acc[j][0]);                                          \
        }                                                                                          \
    }                                                                                              \
}
DPBLOCK(4, 1) DPBLOCK(4, 2) DPBLOCK(4, 3) DPBLOCK(4, 4) DPBLOCK(1, 1) DPBLOCK(1, 2) DPBLOCK(1, 3) DPBLOCK(1, 4)

typedef void (*dp_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t);
static const dp_fn dp4[5] = {NULL, dp_4_1, dp_4_2, dp_4_3, dp_4_4}, dp1[5] = {NULL, dp_1_1, dp_1_2, dp_1_3, dp_1_4};

DP void linear_bf16dp(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
                      int64_t N, int64_t K) {
    int64_t ldb = (K + 31) & ~(int64_t)31, n4 = N & ~(int64_t)3;
    const uint16_t *xb = x_to_bf16(x, ldx, M, K, ldb);
    if (!xb) {   /* no memory for the rounded copy: the widening path needs none */
        for (int64_t m = 0; m < M; m++) for (int64_t n = 0; n < N; n++) {
            float s = 0;
            for (int64_t k = 0; k < K; k++) s += x[m * ldx + k] * from_bf16(w[n * ldw + k]);
            y[m * ldy + n] = s;
        }
        return;
    }
    if (M < 4) {
        v16 part[4][3];
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) {
                const uint16_t *wr = w + (n + r) * ldw;
                if (M == 1) dprow_1(xb, ldb, wr, K, part[r]);
                else if (M == 2) dprow_2(xb, ldb, wr, K, part[r]);
                else dprow_3(xb, ldb, wr, K, part[r]);
            }
            for (int64_t j = 0; j < M; j++) {
                v16 s = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = s[4 * r];
            }
        }
        for (int64_t n = n4; n < N; n++) dp1[M](xb, ldb, w + n * ldw, ldw, y + n, ldy, K);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        int64_t mc = M - m0 < MC ? M - m0 : MC;
        for (int64_t n = 0; n < N; n += n < n4 ? 4 : 1)
            for (int64_t m = m0; m < m0 + mc; m += 4) {
                int64_t mb = m0 + mc - m < 4 ? m0 + mc - m : 4;
                (n < n4 ? dp4 : dp1)[mb](xb + m * ldb, ldb, w + n * ldw, ldw, y + m * ldy + n, ldy, K);
            }
    }
}

int bf16dp_supported(void) {
    unsigned a, b, c, d;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (int)((a >> 5) & 1);   /* CPUID.(EAX=7, ECX=1):EAX bit 5: AVX512_BF16 */
}
#else
int bf16dp_supported(void) { return 0; }
#endif

static int dot_on = -1;   /* -1: not decided yet (the first call decides: on where the CPU has it) */

int bf16_dot(void) {
    if (dot_on < 0) dot_on = bf16dp_supported();
    return dot_on;
}

int64_t wd_bf16_dot(wd_bf16_dot_args *a) {
    a->supported = bf16dp_supported();
    if (a->want == 0) dot_on = 0;
    else if (a->want == 1) dot_on = (int)a->supported;
    return bf16_dot();
}
