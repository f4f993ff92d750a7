/* The streamed small-batch GEMM (gemm.c's linear) for CPUs with AVX2 + FMA and no AVX-512 (AMD Zen 1-3,
   Intel before Skylake-SP), on 8-float __m256 intrinsics. gemm_tpl.h's 16-float vectors are 64 bytes, two
   ymm registers each: GCC lowers them through the stack there (most FMAs read an operand from memory,
   nearly every move is a store and a reload; issue 45 measured 2.3x F.linear's time at 1 row, 14x at 128).
   Here every vector is one register and no block keeps more than 16 live: the inner loops keep them all in
   registers (GCC 12: one store and reload per 48 FMAs in the bfloat16 3-row loop that prefetches, none elsewhere).

   y [M, N] (rows ldy apart) = x [M, K] (rows ldx apart) @ w [N, K]^T (rows ldw apart), w float32 or
   bfloat16 (widened exactly, zero-extend and shift, as it is loaded), sums float32.
   One row of x (memory-bound): each weight row is read once, front to back, into four accumulators (the
   FMA latency), four rows' sums reduced together (at K 1024, N 4096 this reads as fast as torch.sum reads
   the matrix). Two rows and more: blocks of 4 weight rows x MB (1 to 3) rows of x, MB x 4 accumulators + MB
   vectors of x + one of w = 16 registers at MB 3: a weight vector is loaded (and widened) once per MB rows, a
   vector of x once per 4 weight rows; the first block of x rows asks the next 4 weight rows into L2 (measured:
   bfloat16 at 2-4 rows 0.85-0.9x the time without, float32 at 8-16 rows ~0.95x). Features past the last
   multiple of 8: one masked step (bfloat16: through a zero-padded copy); weight rows past the last
   multiple of 4: one at a time. Compiled only where wideep.h's WD_AVX2 says so; elsewhere this file is
   empty. */
#include "wideep.h"

#if WD_AVX2
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

/* 8 weights at w + i as floats; bf: bfloat16 weights (a constant in every instance) */
AI __m256 ldw(const void *w, int64_t i, int bf) {
    if (!bf) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* lanes below n (1 .. 7) set */
AI __m256i mask8(int64_t n) {
    static const int32_t t[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(t + 8 - n));
}

/* the first n (1 .. 7) weights at w + i, zero-padded, never reading past them */
AI __m256 ldw_part(const void *w, int64_t i, int64_t n, int bf) {
    if (!bf) return _mm256_maskload_ps((const float *)w + i, mask8(n));
    uint16_t t[8] = {0};
    memcpy(t, (const uint16_t *)w + i, (size_t)n * sizeof(uint16_t));
    return ldw(t, 0, 1);
}

/* the sums of a, b, c, d */
AI __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

AI float sum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* x . wr in 8 lanes (to be summed): four accumulators, 32 features a step */
AI __m256 row1(const float *x, const void *wr, int64_t K, int bf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
#if WD_PF_AHEAD > 0
        const char *pf = (const char *)wr + k * (bf ? 2 : 4) + WD_PF_AHEAD;
        __builtin_prefetch(pf, 0, WD_PF_HINT);
        if (!bf) __builtin_prefetch(pf + 64, 0, WD_PF_HINT);
#endif
        a0 = _mm256_fmadd_ps(ldw(wr, k, bf), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(ldw(wr, k + 8, bf), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(ldw(wr, k + 16, bf), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(ldw(wr, k + 24, bf), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(ldw(wr, k, bf), _mm256_loadu_ps(x + k), a0);
    if (k < K) a1 = _mm256_fmadd_ps(ldw_part(wr, k, K - k, bf), _mm256_maskload_ps(x + k, mask8(K - k)), a1);
    return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

/* One step of a 4 x MB block: MB vectors of x (LX), then each weight row's vector (LW) against all of them.
   The accumulators are named variables, as gemm_bf16dp.c's (an array of them GCC may keep on the stack). */
#define BLOCK_STEP(LX, LW)                                                                              \
    {                                                                                                   \
        __m256 x0 = LX(x), x1 = MB > 1 ? LX(x + ldx) : x0, x2 = MB > 2 ? LX(x + 2 * ldx) : x0, wv;      \
        wv = LW(w0);                                                                                    \
        a00 = _mm256_fmadd_ps(wv, x0, a00);                                                             \
        if (MB > 1) a10 = _mm256_fmadd_ps(wv, x1, a10);                                                 \
        if (MB > 2) a20 = _mm256_fmadd_ps(wv, x2, a20);                                                 \
        wv = LW(w1);                                                                                    \
        a01 = _mm256_fmadd_ps(wv, x0, a01);                                                             \
        if (MB > 1) a11 = _mm256_fmadd_ps(wv, x1, a11);                                                 \
        if (MB > 2) a21 = _mm256_fmadd_ps(wv, x2, a21);                                                 \
        wv = LW(w2);                                                                                    \
        a02 = _mm256_fmadd_ps(wv, x0, a02);                                                             \
        if (MB > 1) a12 = _mm256_fmadd_ps(wv, x1, a12);                                                 \
        if (MB > 2) a22 = _mm256_fmadd_ps(wv, x2, a22);                                                 \
        wv = LW(w3);                                                                                    \
        a03 = _mm256_fmadd_ps(wv, x0, a03);                                                             \
        if (MB > 1) a13 = _mm256_fmadd_ps(wv, x1, a13);                                                 \
        if (MB > 2) a23 = _mm256_fmadd_ps(wv, x2, a23);                                                 \
    }
#define LX_FULL(p) _mm256_loadu_ps((p) + k)
#define LW_FULL(r) ldw(r, k, bf)
#define LX_TAIL(p) _mm256_maskload_ps((p) + k, tail)
#define LW_TAIL(r) ldw_part(r, k, K - k, bf)

/* y[j, 0..4) = x[j] . w rows 0..4 for j < MB (1 .. 3) */
AI void block4(const float *x, int64_t ldx, const void *w, int64_t ldw_b, float *y, int64_t ldy, int64_t K, int MB,
               int bf, int pf) {
    const char *w0 = w, *w1 = w0 + ldw_b, *w2 = w1 + ldw_b, *w3 = w2 + ldw_b;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    int64_t k = 0;
    if (pf)   /* the next 4 weight rows into L2, a 64-byte line of each per line of weights read */
        for (int64_t step = 64 / (bf ? 2 : 4); k + step <= K;) {
            for (int r = 4; r < 8; r++) __builtin_prefetch(w0 + r * ldw_b + k * (bf ? 2 : 4), 0, 2);
            for (int64_t end = k + step; k < end; k += 8) BLOCK_STEP(LX_FULL, LW_FULL)
        }
    for (; k + 8 <= K; k += 8) BLOCK_STEP(LX_FULL, LW_FULL)
    if (k < K) {
        __m256i tail = mask8(K - k);
        BLOCK_STEP(LX_TAIL, LW_TAIL)
    }
    _mm_storeu_ps(y, sum4(a00, a01, a02, a03));
    if (MB > 1) _mm_storeu_ps(y + ldy, sum4(a10, a11, a12, a13));
    if (MB > 2) _mm_storeu_ps(y + 2 * ldy, sum4(a20, a21, a22, a23));
}
#undef BLOCK_STEP
#undef LX_FULL
#undef LW_FULL
#undef LX_TAIL
#undef LW_TAIL

static void block4_1(const float *x, int64_t ldx, const void *w, int64_t ldw_b, float *y, int64_t ldy, int64_t K, int bf,
                     int pf) {
    if (bf) block4(x, ldx, w, ldw_b, y, ldy, K, 1, 1, pf); else block4(x, ldx, w, ldw_b, y, ldy, K, 1, 0, pf);
}
static void block4_2(const float *x, int64_t ldx, const void *w, int64_t ldw_b, float *y, int64_t ldy, int64_t K, int bf,
                     int pf) {
    if (bf) block4(x, ldx, w, ldw_b, y, ldy, K, 2, 1, pf); else block4(x, ldx, w, ldw_b, y, ldy, K, 2, 0, pf);
}
static void block4_3(const float *x, int64_t ldx, const void *w, int64_t ldw_b, float *y, int64_t ldy, int64_t K, int bf,
                     int pf) {
    if (bf) block4(x, ldx, w, ldw_b, y, ldy, K, 3, 1, pf); else block4(x, ldx, w, ldw_b, y, ldy, K, 3, 0, pf);
}

AI void lin(const float *x, int64_t ldx, const void *w, int64_t ldw, float *y, int64_t ldy, int64_t M, int64_t N,
            int64_t K, int bf) {
    int64_t esz = bf ? 2 : 4, ldw_b = ldw * esz, n4 = N & ~(int64_t)3;
    const char *wb = w;
    if (M == 1) {
        for (int64_t n = 0; n < n4; n += 4) {
            const char *wn = wb + n * ldw_b;
            __m256 s0 = row1(x, wn, K, bf), s1 = row1(x, wn + ldw_b, K, bf), s2 = row1(x, wn + 2 * ldw_b, K, bf),
                   s3 = row1(x, wn + 3 * ldw_b, K, bf);
            _mm_storeu_ps(y + n, sum4(s0, s1, s2, s3));
        }
    } else {
        for (int64_t n = 0; n < n4; n += 4)
            for (int64_t m = 0; m < M;) {
                /* blocks of 3 rows of x; four left: 3 + 1, but 2 + 2 for bfloat16 (a block of one widens 4 weight
                   vectors for 4 FMAs). Measured at 4, 7, 16 rows, K 1024, N 4096: float32 3 + 1 0.93-0.95x the time
                   of 2 + 2, bfloat16 1.03-1.08x */
                int64_t left = M - m, mb = left == 4 && bf ? 2 : left < 3 ? left : 3;
                const float *xm = x + m * ldx;
                const char *wn = wb + n * ldw_b;
                float *ym = y + m * ldy + n;
                int pf = m == 0 && n + 8 <= N;
                if (mb == 3) block4_3(xm, ldx, wn, ldw_b, ym, ldy, K, bf, pf);
                else if (mb == 2) block4_2(xm, ldx, wn, ldw_b, ym, ldy, K, bf, pf);
                else block4_1(xm, ldx, wn, ldw_b, ym, ldy, K, bf, pf);
                m += mb;
            }
    }
    for (int64_t n = n4; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * ldy + n] = sum1(row1(x + m * ldx, wb + n * ldw_b, K, bf));
}

void linear_f32_avx2(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
                     int64_t N, int64_t K) {
    lin(x, ldx, w, ldw, y, ldy, M, N, K, 0);
}

void linear_bf16cvt_avx2(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K) {
    lin(x, ldx, w, ldw, y, ldy, M, N, K, 1);
}

#endif
