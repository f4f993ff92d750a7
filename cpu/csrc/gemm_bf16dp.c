/* The GEMM for bfloat16 weights on AVX512-BF16 (cpu/gemm.py): vdpbf16ps multiplies 32 bfloat16 pairs and
   adds them, two by two, into 16 float32 lanes, so one instruction does the work of two float32 FMAs and
   a 64-byte weight load feeds 32 products instead of 16. x [M, K] float32 is rounded to bfloat16 once per
   call (to nearest even, into this thread's buffer, rows padded with zeros to a multiple of 32); w and x
   are both row major along K, so their pairs line up with no repacking. Sums stay float32.

   This file is compiled with the instructions enabled per function (target attribute), whatever -march
   says, and gemm.c calls it only when bf16_dot() is on: the CPU has them (checked at run time) and no
   one turned them off (wd_bf16_dot; tests run both paths). One to three rows of x against a small matrix
   read each weight row once, front to back (dprow); otherwise blocks of 4 weight rows x up to 4 rows of x
   (dp_4_MB), x in chunks of MC rows so that a chunk's bfloat16 copy stays in L2 while the weights stream
   past it (ROWS4_MIN says where and why). */
#include <stdlib.h>

#include "wideep.h"

#if WD_BF16DP
#include <cpuid.h>
#include <immintrin.h>

#define DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MC 64
/* One to three rows of x against fewer weights than this (elements): one weight row at a time (dprow), as
   gemm.c reads float32; more: blocks of 4 weight rows with the next 4 prefetched (dp_4_MB). Measured A/B,
   two builds in one process, one thread, CPU time, median of 40 interleaved trials: the routed experts of
   a decode step (64 experts of 512 x 512 and 512 x 256, 16 tokens top-6) 2.76 ms one row at a time
   against 3.44 ms in blocks; 2 rows against 8192 x 4096 weights 4.90 ms against 3.47 ms. */
#define ROWS4_MIN ((int64_t)1 << 21)

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

/* The accumulators are named variables, not arrays: GCC keeps an array of them on the stack, storing every
   one after each dot product (measured: 16 rows ran slower than the float32 FMAs). The `if (MB > j)` are
   constants: each instance keeps only its rows. */
#define Z _mm512_setzero_ps()
#define LDX(j, k) _mm512_loadu_si512(xb + (j) * ldb + (k))

/* part[j] (16 lanes whose sum is x[j] . wr) for MB (1-3) rows of x: one weight row, two accumulators a row
   (two dependency chains) */
#define DPROW(MB)                                                                                  \
static DP void dprow_##MB(const uint16_t *xb, int64_t ldb, const uint16_t *wr, int64_t K, v16 *part) { \
    __m512 a0 = Z, a1 = Z, a2 = Z, b0 = Z, b1 = Z, b2 = Z;                                         \
    int64_t k = 0;                                                                                 \
    for (; k + 64 <= K; k += 64) {                                                                 \
        __m512i w0 = _mm512_loadu_si512(wr + k), w1 = _mm512_loadu_si512(wr + k + 32);             \
        a0 = dot(a0, LDX(0, k), w0); b0 = dot(b0, LDX(0, k + 32), w1);                             \
        if (MB > 1) { a1 = dot(a1, LDX(1, k), w0); b1 = dot(b1, LDX(1, k + 32), w1); }             \
        if (MB > 2) { a2 = dot(a2, LDX(2, k), w0); b2 = dot(b2, LDX(2, k + 32), w1); }             \
    }                                                                                              \
    for (; k < K; k += 32) {                                                                       \
        __m512i w0 = _mm512_maskz_loadu_epi16(mask32(K - k), wr + k);                              \
        a0 = dot(a0, LDX(0, k), w0);                                                               \
        if (MB > 1) a1 = dot(a1, LDX(1, k), w0);                                                   \
        if (MB > 2) a2 = dot(a2, LDX(2, k), w0);                                                   \
    }                                                                                              \
    part[0] = (v16)_mm512_add_ps(a0, b0);                                                          \
    if (MB > 1) part[1] = (v16)_mm512_add_ps(a1, b1);                                              \
    if (MB > 2) part[2] = (v16)_mm512_add_ps(a2, b2);                                              \
}
DPROW(1) DPROW(2) DPROW(3)

/* y[j, 0..3] for 4 rows of w x MB (1-4) rows of x: every load shared by the 4 MB accumulators. pf (the first
   block of x rows against these weight rows): the next 4 weight rows asked into L2 as these stream, a
   cache line each per step (measured on 1-16 rows, 8192 x 4096 weights, one thread, min of 6 interleaved
   trials: 3.2-3.3 ms for 1-3 rows against 4.5 ms without the prefetch) */
#define DP4_STEP(MB, LDW)                                                                          \
    {                                                                                              \
        __m512i w0 = LDW(w + k), w1 = LDW(w + ldw + k), w2 = LDW(w + 2 * ldw + k), w3 = LDW(w + 3 * ldw + k); \
        __m512i x0 = LDX(0, k);                                                                    \
        c00 = dot(c00, x0, w0); c01 = dot(c01, x0, w1); c02 = dot(c02, x0, w2); c03 = dot(c03, x0, w3); \
        if (MB > 1) { __m512i x1 = LDX(1, k);                                                      \
            c10 = dot(c10, x1, w0); c11 = dot(c11, x1, w1); c12 = dot(c12, x1, w2); c13 = dot(c13, x1, w3); } \
        if (MB > 2) { __m512i x2 = LDX(2, k);                                                      \
            c20 = dot(c20, x2, w0); c21 = dot(c21, x2, w1); c22 = dot(c22, x2, w2); c23 = dot(c23, x2, w3); } \
        if (MB > 3) { __m512i x3 = LDX(3, k);                                                      \
            c30 = dot(c30, x3, w0); c31 = dot(c31, x3, w1); c32 = dot(c32, x3, w2); c33 = dot(c33, x3, w3); } \
    }
#define LDW_FULL(p) _mm512_loadu_si512(p)
#define LDW_TAIL(p) _mm512_maskz_loadu_epi16(mk, p)
#define DP4(MB)                                                                                    \
static DP void dp_4_##MB(const uint16_t *xb, int64_t ldb, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, \
                         int64_t K, int pf) {                                                      \
    __m512 c00 = Z, c01 = Z, c02 = Z, c03 = Z, c10 = Z, c11 = Z, c12 = Z, c13 = Z;                 \
    __m512 c20 = Z, c21 = Z, c22 = Z, c23 = Z, c30 = Z, c31 = Z, c32 = Z, c33 = Z;                 \
    int64_t k = 0, K32 = K & ~(int64_t)31;                                                         \
    if (pf)                                                                                        \
        for (; k < K32; k += 32) {                                                                 \
            for (int r = 4; r < 8; r++) _mm_prefetch((const char *)(w + r * ldw + k), _MM_HINT_T1); \
            DP4_STEP(MB, LDW_FULL)                                                                 \
        }                                                                                          \
    else                                                                                           \
        for (; k < K32; k += 32) DP4_STEP(MB, LDW_FULL)                                            \
    if (k < K) {                                                                                   \
        __mmask32 mk = mask32(K - k);                                                              \
        DP4_STEP(MB, LDW_TAIL)                                                                     \
    }                                                                                              \
    v16 s = reduce4((v16)c00, (v16)c01, (v16)c02, (v16)c03);                                       \
    for (int r = 0; r < 4; r++) y[r] = s[4 * r];                                                   \
    if (MB > 1) { s = reduce4((v16)c10, (v16)c11, (v16)c12, (v16)c13);                             \
                  for (int r = 0; r < 4; r++) y[ldy + r] = s[4 * r]; }                             \
    if (MB > 2) { s = reduce4((v16)c20, (v16)c21, (v16)c22, (v16)c23);                             \
                  for (int r = 0; r < 4; r++) y[2 * ldy + r] = s[4 * r]; }                         \
    if (MB > 3) { s = reduce4((v16)c30, (v16)c31, (v16)c32, (v16)c33);                             \
                  for (int r = 0; r < 4; r++) y[3 * ldy + r] = s[4 * r]; }                         \
}
DP4(1) DP4(2) DP4(3) DP4(4)

/* y[j] for one row of w x MB (1-4) rows of x (the N % 4 rows left over) */
#define DP1(MB)                                                                                    \
static DP void dp_1_##MB(const uint16_t *xb, int64_t ldb, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, \
                         int64_t K, int pf) {                                                      \
    (void)ldw, (void)pf;                                                                           \
    __m512 c0 = Z, c1 = Z, c2 = Z, c3 = Z;                                                         \
    for (int64_t k = 0; k < K; k += 32) {                                                          \
        __m512i w0 = _mm512_maskz_loadu_epi16(mask32(K - k), w + k);                               \
        c0 = dot(c0, LDX(0, k), w0);                                                               \
        if (MB > 1) c1 = dot(c1, LDX(1, k), w0);                                                   \
        if (MB > 2) c2 = dot(c2, LDX(2, k), w0);                                                   \
        if (MB > 3) c3 = dot(c3, LDX(3, k), w0);                                                   \
    }                                                                                              \
    y[0] = _mm512_reduce_add_ps(c0);                                                               \
    if (MB > 1) y[ldy] = _mm512_reduce_add_ps(c1);                                                 \
    if (MB > 2) y[2 * ldy] = _mm512_reduce_add_ps(c2);                                             \
    if (MB > 3) y[3 * ldy] = _mm512_reduce_add_ps(c3);                                             \
}
DP1(1) DP1(2) DP1(3) DP1(4)

typedef void (*dp_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t, int);
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
    if (M < 4 && N * K < ROWS4_MIN) {
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
        for (int64_t n = n4; n < N; n++) dp1[M](xb, ldb, w + n * ldw, ldw, y + n, ldy, K, 0);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        int64_t mc = M - m0 < MC ? M - m0 : MC;
        for (int64_t n = 0; n < N; n += n < n4 ? 4 : 1)
            for (int64_t m = m0; m < m0 + mc; m += 4) {
                int64_t mb = m0 + mc - m < 4 ? m0 + mc - m : 4;
                (n < n4 ? dp4 : dp1)[mb](xb + m * ldb, ldb, w + n * ldw, ldw, y + m * ldy + n, ldy, K,
                                         m == m0 && n + 8 <= N);
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
