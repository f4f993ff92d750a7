/* gemm_fp4.c's streamed GEMM (FP4 e2m1 weights, an e8m0 scale per 32 along K) for CPUs with AVX2 + FMA and no
   AVX-512, on 8-float __m256 intrinsics, as gemm_avx2.c is gemm.c's. gemm_fp4.c's 16-float vectors are two ymm
   registers each there and GCC lowered them through the stack (GCC 12, -march=x86-64-v3: 116 of its 404 FMAs read
   an operand from the stack, 725 of its 857 ymm moves went through it). Here every vector is one register and no
   loop keeps more than 16 live (the same build: none of its 214 FMAs reads the stack, none of its 81 ymm moves
   goes through it). Measured on the Intel Xeon, the x86-64-v3 build of each, one thread, the routed experts (16
   of H 1024, I 256, top 4) streamed from memory, medians of 25 interleaved calls (a busy machine): 1 / 4 / 16 / 64
   rows an expert 12.5 / 17.6 / 67.9 / 271 ms -> 1.20 / 2.02 / 7.60 / 30.5.

   The same values as gemm_fp4.c: e2m1 value times its power-of-two scale (exact in float32), float32 sums in
   another order. The weights go by chunks of 64 along K: 32 bytes, read as 8 int32 lanes of 8 codes each, lane l
   holding weights 8l .. 8l+7 (weight 8l + j in bits 4j .. 4j+3), lanes 0-3 the chunk's first block of 32, 4-7 its
   second. Nibble j of every lane at once is one shift and one vpermps (its index is the low 3 bits: the
   magnitude, from the 8 of the format), the sign bit two shifts away, xor-ed in: a vector of the weights {8l + j},
   which meets x permuted to match (xp: per chunk, x[8l + j] at 8j + l), so no shuffle puts the weights in order.

   One to three rows of x (memory-bound): each weight row read once, front to back; per chunk the unscaled products
   summed per lane (two chains a row of x), then times the lanes' scales (a power of two: exact); every line of
   weights asks for the one WD_PF_AHEAD bytes further on. Four rows and more: blocks of 2 weight rows x MB (1 to 4)
   rows of x, each nibble's weights times their scales shared by the MB rows (x read into each FMA from L1):
   2 MB accumulators + 2 code and 2 scale vectors + a weight vector and its temporaries = 15 registers at MB 4
   (the first weight row's FMAs before the second row's nibble is widened: both at once, GCC 12 spilled one
   accumulator in the 3-row block); the first block of x rows asks the next 2 weight rows into L2. K a multiple of 32: a chunk of 32 at the end of K has zero
   codes (and zero x) in its second half. Compiled only where wideep.h's WD_AVX2 says so; elsewhere this file is
   empty. */
#include "wideep.h"

#if WD_AVX2
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

/* nibble j (0 .. 7) of each lane of the codes v, as floats */
AI __m256 nib(__m256i v, int j) {
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256 m = _mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(v, 4 * j));
    return _mm256_xor_ps(m, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 4 * j + 3), 31)));
}

/* e8m0 byte -> 2^(b - 127): b 0 is 2^-127 (a float32 subnormal), 255 reads as infinity (as gemm_fp4.c's) */
AI float e8m0(uint8_t b) {
    uint32_t u = b ? (uint32_t)b << 23 : 0x00400000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a chunk's codes and lane scales at column c of a row (codes w, scales s): whole (64 values) or the 32 at the end
   of K (the rest zero, never reading past the row) */
AI __m256i codes(const uint8_t *w, int64_t c, int64_t K) {
    if (c + 64 <= K) return _mm256_loadu_si256((const __m256i *)(w + c / 2));
    return _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)(w + c / 2)), 0);
}
AI __m256 scales(const uint8_t *s, int64_t c, int64_t K) {
    __m128 lo = _mm_set1_ps(e8m0(s[c / 32])), hi = c + 64 <= K ? _mm_set1_ps(e8m0(s[c / 32 + 1])) : _mm_setzero_ps();
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

/* xp [M, K64] (K64: K rounded up to 64) = x [M, K] permuted chunk by chunk to the weights' order, zeros past K */
static void permute_x(const float *x, int64_t ldx, int64_t M, int64_t K, float *xp) {
    int64_t K64 = (K + 63) & ~(int64_t)63;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K64; c += 64)
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < 8; l++) {
                    int64_t k = c + 8 * l + j;
                    xp[m * K64 + c + 8 * j + l] = k < K ? x[m * ldx + k] : 0.0f;
                }
}

AI float sum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define XP(j, n) _mm256_loadu_ps(xp + (j) * ldx + c + 8 * (n))

/* y[j * ldy] = x[j] . w row wr (scales sr) for j < MB (1 .. 3); xp rows ldx apart */
AI void frow(const float *xp, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K, float *y, int64_t ldy,
             int MB) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0;
    for (int64_t c = 0; c < K; c += 64) {
#if WD_PF_AHEAD > 0
        if (!(c & 127)) __builtin_prefetch(wr + c / 2 + WD_PF_AHEAD, 0, WD_PF_HINT);
#endif
        __m256i v = codes(wr, c, K);
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, u0 = t0, u1 = t0, u2 = t0;
        for (int n = 0; n < 8; n += 2) {
            __m256 w0 = nib(v, n), w1 = nib(v, n + 1);
            t0 = _mm256_fmadd_ps(w0, XP(0, n), t0);
            u0 = _mm256_fmadd_ps(w1, XP(0, n + 1), u0);
            if (MB > 1) { t1 = _mm256_fmadd_ps(w0, XP(1, n), t1); u1 = _mm256_fmadd_ps(w1, XP(1, n + 1), u1); }
            if (MB > 2) { t2 = _mm256_fmadd_ps(w0, XP(2, n), t2); u2 = _mm256_fmadd_ps(w1, XP(2, n + 1), u2); }
        }
        __m256 sv = scales(sr, c, K);
        a0 = _mm256_fmadd_ps(_mm256_add_ps(t0, u0), sv, a0);
        if (MB > 1) a1 = _mm256_fmadd_ps(_mm256_add_ps(t1, u1), sv, a1);
        if (MB > 2) a2 = _mm256_fmadd_ps(_mm256_add_ps(t2, u2), sv, a2);
    }
    y[0] = sum1(a0);
    if (MB > 1) y[ldy] = sum1(a1);
    if (MB > 2) y[2 * ldy] = sum1(a2);
}

static void frow_1(const float *xp, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K, float *y,
                   int64_t ldy) {
    frow(xp, ldx, wr, sr, K, y, ldy, 1);
}
static void frow_2(const float *xp, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K, float *y,
                   int64_t ldy) {
    frow(xp, ldx, wr, sr, K, y, ldy, 2);
}
static void frow_3(const float *xp, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K, float *y,
                   int64_t ldy) {
    frow(xp, ldx, wr, sr, K, y, ldy, 3);
}
typedef void (*frow_fn)(const float *, int64_t, const uint8_t *, const uint8_t *, int64_t, float *, int64_t);
static const frow_fn frows[4] = {NULL, frow_1, frow_2, frow_3};

/* one weight vector (wv, of weight row r) against the MB rows of x (GCC reads x into each FMA from L1) */
#define BLOCK_W(wv, r)                                                                                  \
    {                                                                                                   \
        c0##r = _mm256_fmadd_ps(wv, XP(0, n), c0##r);                                                   \
        if (MB > 1) c1##r = _mm256_fmadd_ps(wv, XP(1, n), c1##r);                                       \
        if (MB > 2) c2##r = _mm256_fmadd_ps(wv, XP(2, n), c2##r);                                       \
        if (MB > 3) c3##r = _mm256_fmadd_ps(wv, XP(3, n), c3##r);                                       \
    }

/* y[j, 0..2) (rows ldy apart) = x[j] . weight rows w, w + ldw (scale rows s, s + lds) for j < MB (1 .. 4) */
AI void fblock(const float *xp, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds, float *y,
               int64_t ldy, int64_t K, int MB, int pf) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    for (int64_t c = 0; c < K; c += 64) {
        if (pf && !(c & 127)) {   /* the next 2 weight rows into L2, a line of each per line of these */
            __builtin_prefetch(w + 2 * ldw + c / 2, 0, 2);
            __builtin_prefetch(w + 3 * ldw + c / 2, 0, 2);
        }
        __m256i v0 = codes(w, c, K), v1 = codes(w + ldw, c, K);
        __m256 s0 = scales(s, c, K), s1 = scales(s + lds, c, K);
        for (int n = 0; n < 8; n++) {
            __m256 w0 = _mm256_mul_ps(nib(v0, n), s0);
            BLOCK_W(w0, 0)
            __m256 w1 = _mm256_mul_ps(nib(v1, n), s1);
            BLOCK_W(w1, 1)
        }
    }
    __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(c00, c01), _mm256_hadd_ps(c10, c11));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));   /* y[0, 0..2), y[1, 0..2) */
    y[0] = t[0];
    y[1] = t[1];
    if (MB > 1) { y[ldy] = t[2]; y[ldy + 1] = t[3]; }
    if (MB > 2) {
        q = _mm256_hadd_ps(_mm256_hadd_ps(c20, c21), _mm256_hadd_ps(c30, c31));
        t = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
        y[2 * ldy] = t[0];
        y[2 * ldy + 1] = t[1];
        if (MB > 3) { y[3 * ldy] = t[2]; y[3 * ldy + 1] = t[3]; }
    }
}
#undef BLOCK_W
#undef XP

#define FBLOCK(MB)                                                                                      \
    static void fblock_##MB(const float *xp, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, \
                            int64_t lds, float *y, int64_t ldy, int64_t K, int pf) {                    \
        fblock(xp, ldx, w, ldw, s, lds, y, ldy, K, MB, pf);                                             \
    }
FBLOCK(1) FBLOCK(2) FBLOCK(3) FBLOCK(4)
#undef FBLOCK
typedef void (*fblock_fn)(const float *, int64_t, const uint8_t *, int64_t, const uint8_t *, int64_t, float *,
                          int64_t, int64_t, int);
static const fblock_fn fblocks[5] = {NULL, fblock_1, fblock_2, fblock_3, fblock_4};

/* gemm_fp4.c's linear_fp4: y [M, N] = x [M, K] @ (w [N, K/2] e2m1 pairs * e8m0 scales s [N, K/32])^T; xp: the
   FP4_XP(M, K) floats of scratch (x permuted, rows K rounded up to 64 apart) */
void linear_fp4_avx2(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds,
                     float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, float *xp) {
    int64_t K64 = (K + 63) & ~(int64_t)63, n2 = M < 4 ? 0 : N & ~(int64_t)1;
    permute_x(x, ldx, M, K, xp);
    for (int64_t n = 0; n < n2; n += 2)
        for (int64_t m = 0; m < M;) {
            int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
            fblocks[mb](xp + m * K64, K64, w + n * ldw, ldw, s + n * lds, lds, y + m * ldy + n, ldy, K,
                        m == 0 && n + 4 <= N);
            m += mb;
        }
    for (int64_t n = n2; n < N; n++)   /* every row with 1 .. 3 rows of x, the last odd one with more */
        for (int64_t m = 0; m < M; m += 3)
            frows[M - m < 3 ? M - m : 3](xp + m * K64, K64, w + n * ldw, s + n * lds, K, y + m * ldy + n, ldy);
}

#endif
