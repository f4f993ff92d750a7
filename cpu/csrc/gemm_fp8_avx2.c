/* gemm_fp8.c's streamed GEMM (FP8 e4m3 weights, a float32 scale per br x bk block) for CPUs with AVX2 + FMA and
   no AVX-512, on 8-float __m256 intrinsics, as gemm_avx2.c is gemm.c's. gemm_fp8.c's 16-float vectors are two
   ymm registers each there and GCC lowered them through the stack (GCC 12, -march=x86-64-v3: 330 of its 448
   FMAs read an operand from the stack, 1245 of its 1429 ymm moves went through it). Here every vector is one
   register and no loop keeps more than 16 live (the same build: none of its 134 FMAs reads the stack, none of its
   52 ymm moves goes through it). GCC had also turned gemm_fp8.c's integer e4m3 widening into byte-by-byte scalar
   code there. Measured on the Intel Xeon, the x86-64-v3 build of each, one thread, N 2048, 128 x 128 blocks,
   weights streamed from memory, medians of 25 interleaved calls (a busy machine): K 1024 at 1 / 3 / 4 / 16 / 64
   rows 5.45 / 5.60 / 6.27 / 24.7 / 99.8 ms -> 0.25 / 0.31 / 0.32 / 1.27 / 5.30 (8.3 GB/s of fp8 at 1 row); K 7168
   38.5 -> 1.73 ms at 1 row, 686 -> 39.0 at 64.

   The same values as gemm_fp8.c: each weight widened to float32 exactly and multiplied by its block's scale
   (dequantize_fp8_block's float32 value), then one FMA per row of x; sums float32, in another order.
   e4m3 -> float32 by F16C (part of x86-64-v3): the byte moved into a float16 whose exponent field is the e4m3
   one (the value times 2^-8, subnormals included), widened by vcvtph2ps, the 2^8 folded into the scale; bytes
   0x7f / 0xff read as +-480, as gemm_fp8.c's. 16 weights at a time (one vcvtph2ps per 8, the shifts on 16).

   One to three rows of x (memory-bound): each weight row read once, front to back, 16 weights a step into two
   accumulators a row of x (the FMA latency), the row's sums reduced at its end; every line of weights asks for
   the one WD_PF_AHEAD bytes further on (the hardware prefetcher stops at each 4 KiB page). Four rows and more:
   blocks of 2 weight rows x MB (1 to 4) rows of x, 2 MB accumulators + 4 dequantised weight vectors + 2 scales
   + the sign mask = 15 registers at MB 4: each weight is widened once per MB rows, x read into each FMA from L1
   (GCC folds the load in; 4 weight rows do not fit: their 4 scale vectors and 8 widened weights alone take 12);
   the first block of x rows asks the next 2 weight rows into L2. Features past the last multiple of 16 (only at the
   end of K: bk is a multiple of 16): a zero-padded copy of the weights and masked loads of x. Compiled only
   where wideep.h's WD_AVX2 says so; elsewhere this file is empty. */
#include "wideep.h"

#if WD_AVX2
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

/* 16 e4m3 bytes b times the scale sv (the block's scale times 2^8): the first 8 in *lo, the rest in *hi */
AI void e4m3v(__m128i b, __m256 sv, __m256 *lo, __m256 *hi) {
    __m256i w = _mm256_cvtepu8_epi16(b);
    __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16((short)0xbfff));
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sv);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sv);
}

AI void e4m3x16(const uint8_t *p, __m256 sv, __m256 *lo, __m256 *hi) {
    e4m3v(_mm_loadu_si128((const __m128i *)p), sv, lo, hi);
}

/* the first n (1 .. 15) weights at p, zero-padded, never reading past them: gathered in two integers (a copy
   through memory became a call of memcpy, around which GCC saved every live vector on the stack) */
AI void e4m3x16_part(const uint8_t *p, int64_t n, __m256 sv, __m256 *lo, __m256 *hi) {
    uint64_t b[2] = {0, 0};
    for (int64_t i = 0; i < n; i++) b[i >> 3] |= (uint64_t)p[i] << (8 * (i & 7));
    e4m3v(_mm_set_epi64x((long long)b[1], (long long)b[0]), sv, lo, hi);
}

/* lanes below n (0 .. 8; clamped) set */
AI __m256i mask8(int64_t n) {
    static const int32_t t[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(t + 8 - (n < 0 ? 0 : n > 8 ? 8 : n)));
}

AI float sum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* the sums of a, b, c, d */
AI __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

#define XV(j, o) _mm256_loadu_ps(x + (j) * ldx + (o))
#define XT(j, o) _mm256_maskload_ps(x + (j) * ldx + (o), mask8(k1 - (o)))

/* 16 weights of one row (lo, hi) against MB rows of x at k (LX: whole or masked loads) */
#define ROW_STEP(LX)                                                                                    \
    {                                                                                                   \
        a0 = _mm256_fmadd_ps(lo, LX(0, k), a0);                                                         \
        b0 = _mm256_fmadd_ps(hi, LX(0, k + 8), b0);                                                     \
        if (MB > 1) { a1 = _mm256_fmadd_ps(lo, LX(1, k), a1); b1 = _mm256_fmadd_ps(hi, LX(1, k + 8), b1); } \
        if (MB > 2) { a2 = _mm256_fmadd_ps(lo, LX(2, k), a2); b2 = _mm256_fmadd_ps(hi, LX(2, k + 8), b2); } \
    }

/* y[j * ldy] = x[j] . w row wr (block scales sr) for j < MB (1 .. 3) */
AI void frow(const float *x, int64_t ldx, const uint8_t *wr, const float *sr, int64_t bk, int64_t K, float *y,
             int64_t ldy, int MB) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0, lo, hi;
    for (int64_t k0 = 0; k0 < K; k0 += bk) {
        __m256 sv = _mm256_set1_ps(sr[k0 / bk] * 256.0f);
        int64_t k1 = k0 + bk < K ? k0 + bk : K, k = k0;
        for (; k + 16 <= k1; k += 16) {
#if WD_PF_AHEAD > 0
            if (!(k & 63)) __builtin_prefetch(wr + k + WD_PF_AHEAD, 0, WD_PF_HINT);
#endif
            e4m3x16(wr + k, sv, &lo, &hi);
            ROW_STEP(XV)
        }
        if (k < k1) {
            e4m3x16_part(wr + k, k1 - k, sv, &lo, &hi);
            ROW_STEP(XT)
        }
    }
    y[0] = sum1(_mm256_add_ps(a0, b0));
    if (MB > 1) y[ldy] = sum1(_mm256_add_ps(a1, b1));
    if (MB > 2) y[2 * ldy] = sum1(_mm256_add_ps(a2, b2));
}
#undef ROW_STEP

static void frow_1(const float *x, int64_t ldx, const uint8_t *wr, const float *sr, int64_t bk, int64_t K, float *y,
                   int64_t ldy) {
    frow(x, ldx, wr, sr, bk, K, y, ldy, 1);
}
static void frow_2(const float *x, int64_t ldx, const uint8_t *wr, const float *sr, int64_t bk, int64_t K, float *y,
                   int64_t ldy) {
    frow(x, ldx, wr, sr, bk, K, y, ldy, 2);
}
static void frow_3(const float *x, int64_t ldx, const uint8_t *wr, const float *sr, int64_t bk, int64_t K, float *y,
                   int64_t ldy) {
    frow(x, ldx, wr, sr, bk, K, y, ldy, 3);
}
typedef void (*frow_fn)(const float *, int64_t, const uint8_t *, const float *, int64_t, int64_t, float *, int64_t);
static const frow_fn frows[4] = {NULL, frow_1, frow_2, frow_3};

/* row j of x against both weight rows: l0 h0 (row 0), l1 h1 (row 1) */
#define BLOCK_ROW(LX, j, c0, c1)                                                                        \
    if (MB > (j)) {                                                                                     \
        __m256 xv = LX(j, k);                                                                           \
        c0 = _mm256_fmadd_ps(l0, xv, c0);                                                               \
        c1 = _mm256_fmadd_ps(l1, xv, c1);                                                               \
        xv = LX(j, k + 8);                                                                              \
        c0 = _mm256_fmadd_ps(h0, xv, c0);                                                               \
        c1 = _mm256_fmadd_ps(h1, xv, c1);                                                               \
    }
#define BLOCK_STEP(LX)                                                                                  \
    {                                                                                                   \
        BLOCK_ROW(LX, 0, c00, c01) BLOCK_ROW(LX, 1, c10, c11) BLOCK_ROW(LX, 2, c20, c21)                \
        BLOCK_ROW(LX, 3, c30, c31)                                                                      \
    }

/* y[j, 0..2) (rows ldy apart) = x[j] . weight rows w, w + ldw (block scales s0, s1) for j < MB (1 .. 4) */
AI void fblock(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s0, const float *s1,
               int64_t bk, float *y, int64_t ldy, int64_t K, int MB, int pf) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    __m256 l0, h0, l1, h1;
    for (int64_t k0 = 0; k0 < K; k0 += bk) {
        __m256 v0 = _mm256_set1_ps(s0[k0 / bk] * 256.0f), v1 = _mm256_set1_ps(s1[k0 / bk] * 256.0f);
        int64_t k1 = k0 + bk < K ? k0 + bk : K, k = k0;
        for (; k + 16 <= k1; k += 16) {
            if (pf && !(k & 63)) {   /* the next 2 weight rows into L2, a line of each per line of these */
                __builtin_prefetch(w + 2 * ldw + k, 0, 2);
                __builtin_prefetch(w + 3 * ldw + k, 0, 2);
            }
            e4m3x16(w + k, v0, &l0, &h0);
            e4m3x16(w + ldw + k, v1, &l1, &h1);
            BLOCK_STEP(XV)
        }
        if (k < k1) {
            e4m3x16_part(w + k, k1 - k, v0, &l0, &h0);
            e4m3x16_part(w + ldw + k, k1 - k, v1, &l1, &h1);
            BLOCK_STEP(XT)
        }
    }
    __m128 t = sum4(c00, c01, c10, c11);   /* y[0, 0], y[0, 1], y[1, 0], y[1, 1] */
    y[0] = t[0];
    y[1] = t[1];
    if (MB > 1) { y[ldy] = t[2]; y[ldy + 1] = t[3]; }
    if (MB > 2) {
        t = sum4(c20, c21, c30, c31);
        y[2 * ldy] = t[0];
        y[2 * ldy + 1] = t[1];
        if (MB > 3) { y[3 * ldy] = t[2]; y[3 * ldy + 1] = t[3]; }
    }
}
#undef BLOCK_ROW
#undef BLOCK_STEP
#undef XV
#undef XT

#define FBLOCK(MB)                                                                                      \
    static void fblock_##MB(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s0,   \
                            const float *s1, int64_t bk, float *y, int64_t ldy, int64_t K, int pf) {    \
        fblock(x, ldx, w, ldw, s0, s1, bk, y, ldy, K, MB, pf);                                          \
    }
FBLOCK(1) FBLOCK(2) FBLOCK(3) FBLOCK(4)
#undef FBLOCK
typedef void (*fblock_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, const float *, int64_t,
                          float *, int64_t, int64_t, int);
static const fblock_fn fblocks[5] = {NULL, fblock_1, fblock_2, fblock_3, fblock_4};

/* gemm_fp8.c's linear_fp8: y [M, N] = x [M, K] @ (w [N, K] e4m3 * block scales s [ceil(N/br), ceil(K/bk)])^T */
void linear_fp8_avx2(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                     int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t n2 = M < 4 ? 0 : N & ~(int64_t)1;
    for (int64_t n = 0; n < n2; n += 2)
        for (int64_t m = 0; m < M;) {
            int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
            fblocks[mb](x + m * ldx, ldx, w + n * ldw, ldw, s + n / br * lds, s + (n + 1) / br * lds, bk,
                        y + m * ldy + n, ldy, K, m == 0 && n + 4 <= N);
            m += mb;
        }
    for (int64_t n = n2; n < N; n++)   /* every row with 1 .. 3 rows of x, the last odd one with more */
        for (int64_t m = 0; m < M; m += 3)
            frows[M - m < 3 ? M - m : 3](x + m * ldx, ldx, w + n * ldw, s + n / br * lds, bk, K, y + m * ldy + n, ldy);
}

#endif
