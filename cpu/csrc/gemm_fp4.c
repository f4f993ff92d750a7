/* The streamed GEMM for FP4 weights as DeepSeek-V4 stores its routed experts (cpu/gemm.py linear_fp4, the
   routed experts of a V4 checkpoint kept packed): w [N, K/2] bytes, two e2m1 codes a byte (column 2j in the
   low nibble, 2j+1 in the high one), and one e8m0 scale byte per 32 values along K, s [N, K/32] (rows lds
   apart): W[n, k] = e2m1(code) * 2^(s[n, k/32] - 127), moe/fp4.py. Every 32 weights are widened to float32 in
   registers as they stream in; each product of an e2m1 value and a power of two is exact in float32, so the
   sums are the float32 GEMM's on dequantize_fp4's weights, up to the order of the additions. Activations and
   sums float32. K must be a multiple of 32 (a scale's block is whole; the launcher checks, and the kernel
   refuses otherwise); N is free.

   Why: decode streams every weight once a step, so its time is the bytes it reads: half a byte a weight
   (plus 1/32 of a byte of scale) is an eighth of float32's and half of fp8's.

   e2m1 -> float32: 128 weights (64 bytes) at a time, as 16 int32 lanes of 8 codes; each of the 8 nibble
   positions is one shift away, and x is permuted once per call to meet the weights in that order (below). On
   AVX-512 the 16 values of the format sit in one register and vpermps picks each lane's by its nibble (the
   low 4 bits of a 32-bit index): one shuffle-port operation per 16 weights, where widening the bytes in order
   took three (measured on this CPU, bench/fp4_experts.py's experts, warm, best of 5: 1.03 -> 0.64 ms at 1 token,
   9.3 -> 6.4 ms at 16). AVX2 without AVX-512: gemm_fp4_avx2.c. Elsewhere: integer
   operations build the float's bits (magnitude codes 2..7 are normals 2^(e-1) * (1 + m/2); 1 is 0.5; 0 is 0).
   The scales: a lane vector of each lane's block scale per chunk. The loops are gemm_fp8.c's: one to three
   rows of x read each weight row once, front to back; four or more rows run blocks of 4 weight rows x up to 4
   rows of x sharing every load. */
#include "wideep.h"

/* e8m0 byte -> 2^(b - 127): b 0 is 2^-127 (a float32 subnormal), 255 reads as infinity (no quantiser writes it) */
static inline float e8m0(uint8_t b) {
    if (!b) return 0x1p-127f;
    uint32_t u = (uint32_t)b << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static const float E2M1_TAB[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

#if WD_AVX2   /* 8-float vectors instead (gemm_fp4_avx2.c): 16-float ones spill without AVX-512 */
void linear_fp4(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds,
                float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, float *xp) {
    linear_fp4_avx2(x, ldx, w, ldw, s, lds, y, ldy, M, N, K, xp);
}
#else

/* The weights go by chunks of 128 along K: 64 bytes, read as 16 int32 lanes of 8 codes each, lane l holding
   weights 8l .. 8l+7 with weight 8l + j in bits 4j .. 4j+3. Nibble j of every lane at once is one shift and
   one table lookup: a vector of the weights {8l + j}, which meets x permuted to match (xp below: per chunk,
   x[8l + j] at 16 j + l), so no shuffle ever puts the weights back in order. Lanes 4b .. 4b+3 are block b of
   the chunk: the scale vector holds each lane's block scale. */
typedef uint32_t u32v __attribute__((vector_size(64)));
#ifdef __AVX512F__
typedef __m512i codes_t;
static inline codes_t ld_codes(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline v16 nib(codes_t v, v16 tab) { return (v16)_mm512_permutexvar_ps(v, (__m512)tab); }
static inline codes_t next_nib(codes_t v) { return _mm512_srli_epi32(v, 4); }
#else
typedef u32v codes_t;
static inline codes_t ld_codes(const uint8_t *p) { codes_t v; memcpy(&v, p, 64); return v; }
/* e2m1 codes (low 4 bits of each lane) -> their values: magnitude codes 2..7 are normals, 1 is 0.5, 0 is 0 */
static inline v16 nib(codes_t v, v16 tab) {
    (void)tab;
    i16 c = (i16)(v & 15), mag = c & 7, sign = (c & 8) << 28;
    i16 normal = (mag << 22) + (126 << 23);
    i16 bits = ((mag >= 2) & normal) | ((mag == 1) & (126 << 23));
    return (v16)(bits | sign);
}
static inline codes_t next_nib(codes_t v) { return v >> 4; }
#endif

/* the chunk's 4 scale bytes (b0 .. b3 of word) -> lane l: 2^(b[l/4] - 127) */
static inline v16 scale16(uint32_t word) {
    const u32v sh = {0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24};
    u32v e = (((u32v){0} + word) >> sh) & 0xff;
    i16 bits = (i16)(e << 23) | ((i16)(e == 0) & 0x00400000);
    return (v16)bits;
}

/* a chunk's codes and scale word: whole (n = 128 values) or the tail of K (n = 32, 64, 96: zero codes past it,
   never reading past the row) */
static inline void chunk(const uint8_t *w, const uint8_t *s, int64_t n, codes_t *v, uint32_t *sw) {
    if (n == 128) {
        *v = ld_codes(w);
        memcpy(sw, s, 4);
        return;
    }
    uint8_t t[64] = {0};
    memcpy(t, w, n / 2);
    *v = ld_codes(t);
    *sw = 0;
    memcpy(sw, s, n / 32);
}

/* xp [M, K128] (K128: K rounded up to 128) = x [M, K] permuted chunk by chunk to the weights' order, zeros past K */
static void permute_x(const float *x, int64_t ldx, int64_t M, int64_t K, float *xp) {
    int64_t K128 = (K + 127) & ~(int64_t)127;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K128; c += 128)
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < 16; l++) {
                    int64_t k = c + 8 * l + j;
                    xp[m * K128 + c + 16 * j + l] = k < K ? x[m * ldx + k] : 0.0f;
                }
}

#define XP(j, c, n) ld(xp + (j) * ldx + (c) + 16 * (n))

/* part[j] (16 lanes whose sum is x[j] . w) for MB (1-3) rows of permuted x (rows ldx apart) against weight row
   wr, its scales sr: per chunk the unscaled products summed per lane (two chains), then times the lanes' scales */
#define FROW(MB)                                                                                   \
static inline void frow4_##MB(const float *xp, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K, \
                              v16 *part, const uint8_t *pf, v16 tab) {                             \
    v16 a0 = bc(0), a1 = a0, a2 = a0;                                                              \
    for (int64_t c = 0; c < K; c += 128) {                                                         \
        if (pf) __builtin_prefetch(pf + c / 2, 0, 2);                                              \
        codes_t v;                                                                                 \
        uint32_t sw;                                                                               \
        chunk(wr + c / 2, sr + c / 32, K - c < 128 ? K - c : 128, &v, &sw);                        \
        v16 sv = scale16(sw), t0 = bc(0), t1 = t0, t2 = t0, u0 = t0, u1 = t0, u2 = t0;             \
        for (int n = 0; n < 8; n += 2) {                                                           \
            v16 w0 = nib(v, tab);                                                                  \
            v = next_nib(v);                                                                       \
            v16 w1 = nib(v, tab);                                                                  \
            v = next_nib(v);                                                                       \
            t0 += w0 * XP(0, c, n); u0 += w1 * XP(0, c, n + 1);                                    \
            if (MB > 1) { t1 += w0 * XP(1, c, n); u1 += w1 * XP(1, c, n + 1); }                    \
            if (MB > 2) { t2 += w0 * XP(2, c, n); u2 += w1 * XP(2, c, n + 1); }                    \
        }                                                                                          \
        a0 += (t0 + u0) * sv;                                                                      \
        if (MB > 1) a1 += (t1 + u1) * sv;                                                          \
        if (MB > 2) a2 += (t2 + u2) * sv;                                                          \
    }                                                                                              \
    part[0] = a0;                                                                                  \
    if (MB > 1) part[1] = a1;                                                                      \
    if (MB > 2) part[2] = a2;                                                                      \
}
FROW(1) FROW(2) FROW(3)
#undef FROW

#define FOUT(j, c0, c1, c2, c3)                                                                    \
    { v16 t = reduce4(c0, c1, c2, c3); for (int r = 0; r < 4; r++) y[(j) * ldy + r] = t[4 * r]; }
#define ACC(j, c0, c1, c2, c3)                                                                     \
    { v16 xv = XP(j, c, n); c0 += w0 * xv; c1 += w1 * xv; c2 += w2 * xv; c3 += w3 * xv; }
/* y[j, 0..3] (rows ldy apart) for 4 weight rows (ldw apart; scale rows lds apart) x MB (1-4) rows of permuted x:
   each nibble's weights times their scales, shared by the MB rows */
#define FBLOCK(MB)                                                                                 \
static void fblock4_##MB(const float *xp, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s,  \
                         int64_t lds, float *y, int64_t ldy, int64_t K, int pf, v16 tab) {         \
    v16 c00 = bc(0), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;  \
    v16 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;    \
    for (int64_t c = 0; c < K; c += 128) {                                                         \
        int64_t nk = K - c < 128 ? K - c : 128;                                                    \
        if (pf) for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + c / 2, 0, 2);         \
        codes_t v0, v1, v2, v3;                                                                    \
        uint32_t q0, q1, q2, q3;                                                                   \
        chunk(w + c / 2, s + c / 32, nk, &v0, &q0);                                                \
        chunk(w + ldw + c / 2, s + lds + c / 32, nk, &v1, &q1);                                    \
        chunk(w + 2 * ldw + c / 2, s + 2 * lds + c / 32, nk, &v2, &q2);                            \
        chunk(w + 3 * ldw + c / 2, s + 3 * lds + c / 32, nk, &v3, &q3);                            \
        v16 s0 = scale16(q0), s1 = scale16(q1), s2 = scale16(q2), s3 = scale16(q3);                \
        for (int n = 0; n < 8; n++) {                                                              \
            v16 w0 = nib(v0, tab) * s0, w1 = nib(v1, tab) * s1, w2 = nib(v2, tab) * s2, w3 = nib(v3, tab) * s3; \
            v0 = next_nib(v0); v1 = next_nib(v1); v2 = next_nib(v2); v3 = next_nib(v3);            \
            KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3);                                                \
            ACC(0, c00, c01, c02, c03)                                                             \
            if (MB > 1) ACC(1, c10, c11, c12, c13)                                                 \
            if (MB > 2) ACC(2, c20, c21, c22, c23)                                                 \
            if (MB > 3) ACC(3, c30, c31, c32, c33)                                                 \
        }                                                                                          \
    }                                                                                              \
    FOUT(0, c00, c01, c02, c03)                                                                    \
    if (MB > 1) FOUT(1, c10, c11, c12, c13)                                                        \
    if (MB > 2) FOUT(2, c20, c21, c22, c23)                                                        \
    if (MB > 3) FOUT(3, c30, c31, c32, c33)                                                        \
}
FBLOCK(1) FBLOCK(2) FBLOCK(3) FBLOCK(4)
#undef FBLOCK
#undef ACC
#undef FOUT

typedef void (*fblock4_fn)(const float *, int64_t, const uint8_t *, int64_t, const uint8_t *, int64_t, float *,
                           int64_t, int64_t, int, v16);
static const fblock4_fn fblock4[5] = {NULL, fblock4_1, fblock4_2, fblock4_3, fblock4_4};

static inline float hsum(v16 v) {
    float t = 0;
    for (int l = 0; l < 16; l++) t += v[l];
    return t;
}

static inline void frow4(int64_t mb, const float *xp, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K,
                         v16 *part, const uint8_t *pf, v16 tab) {
    if (mb == 1) frow4_1(xp, ldx, wr, sr, K, part, pf, tab);
    else if (mb == 2) frow4_2(xp, ldx, wr, sr, K, part, pf, tab);
    else frow4_3(xp, ldx, wr, sr, K, part, pf, tab);
}

/* y [M, N] (rows ldy apart) = x [M, K] @ W^T, W [N, K] = w (e2m1 pairs, rows ldw bytes apart) times its e8m0
   scales s ([N, K/32], rows lds apart). K % 32 == 0. xp: M * K128 floats of scratch (x permuted). */
void linear_fp4(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds,
                float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, float *xp) {
    int64_t n4 = N & ~(int64_t)3, K128 = (K + 127) & ~(int64_t)127;
    v16 tab = ld(E2M1_TAB);
    KEEP(tab);
    permute_x(x, ldx, M, K, xp);
    if (M < 4) {
        v16 part[4][3];
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) {   /* the row 4 ahead asked into L2 as this one streams */
                const uint8_t *wr = w + (n + r) * ldw, *pf = n + r + 4 < N ? wr + 4 * ldw : NULL;
                frow4(M, xp, K128, wr, s + (n + r) * lds, K, part[r], pf, tab);
            }
            for (int64_t j = 0; j < M; j++) {
                v16 t = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = t[4 * r];
            }
        }
        for (int64_t n = n4; n < N; n++) {
            frow4(M, xp, K128, w + n * ldw, s + n * lds, K, part[0], NULL, tab);
            for (int64_t j = 0; j < M; j++) y[j * ldy + n] = hsum(part[0][j]);
        }
        return;
    }
    for (int64_t n = 0; n < n4; n += 4)
        for (int64_t m = 0; m < M;) {
            int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
            fblock4[mb](xp + m * K128, K128, w + n * ldw, ldw, s + n * lds, lds, y + m * ldy + n, ldy, K,
                        m == 0 && n + 8 <= N, tab);
            m += mb;
        }
    for (int64_t n = n4; n < N; n++)
        for (int64_t m = 0; m < M; m += 3) {
            v16 part[3];
            int64_t mb = M - m < 3 ? M - m : 3;
            frow4(mb, xp + m * K128, K128, w + n * ldw, s + n * lds, K, part, NULL, tab);
            for (int64_t j = 0; j < mb; j++) y[(m + j) * ldy + n] = hsum(part[j]);
        }
}

#endif

/* out [N, K] (rows ldo apart, float32 or bfloat16: odt) = the dequantised weight, value by value (a check on
   the vector path, and the copy BLAS would run on) */
static void fp4_dequant(const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds, int64_t N, int64_t K,
                        void *out, int64_t ldo, int64_t odt) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            uint8_t b = w[n * ldw + k / 2];
            float v = E2M1_TAB[k & 1 ? b >> 4 : b & 15] * e8m0(s[n * lds + k / 32]);
            if (odt == WD_BF16) ((uint16_t *)out)[n * ldo + k] = to_bf16(v);
            else ((float *)out)[n * ldo + k] = v;
        }
}

int64_t wd_linear_fp4(const wd_linear_fp4_args *a) {
    if (a->K % 32 || a->K < 0) return -1;
    if (a->x == NULL) fp4_dequant(a->w, a->ldw, a->s, a->lds, a->N, a->K, a->y, a->ldy, a->odt);
    else if (!a->xp) return -1;
    else linear_fp4(a->x, a->ldx, a->w, a->ldw, a->s, a->lds, a->y, a->ldy, a->M, a->N, a->K, a->xp);
    return 0;
}
