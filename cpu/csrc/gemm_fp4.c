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

   e2m1 -> float32: on AVX-512 the 16 values of the format (times the block's scale) sit in one register and
   vpermps picks each weight's by its nibble (the low 4 bits of a 32-bit lane index it: the byte zero-extended
   for the even column, shifted right by 4 for the odd one). Elsewhere: integer operations build the float's
   bits (magnitude codes 2..7 are normals 2^(e-1) * (1 + m/2); code 1 is 0.5; 0 is 0), times the scale.
   The loops are gemm_fp8.c's: one to three rows of x read each weight row once, front to back, with two
   accumulators a row; four or more rows run blocks of 4 weight rows x up to 4 rows of x sharing every load. */
#include "wideep.h"

/* e8m0 byte -> 2^(b - 127): b 0 is 2^-127 (a float32 subnormal), 255 reads as infinity (no quantiser writes it) */
static inline float e8m0(uint8_t b) {
    if (!b) return 0x1p-127f;
    uint32_t u = (uint32_t)b << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef __AVX512F__
static const float E2M1_TAB[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
/* what dec32 needs of a block's scale: the 16 values times it */
static inline v16 fp4_tab(float s) { return ld(E2M1_TAB) * bc(s); }
/* 32 weights (16 bytes at p) -> w0 (columns 0..15), w1 (16..31), times the scale folded into t */
static inline void dec32(const uint8_t *p, v16 t, v16 *w0, v16 *w1) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m512i sh = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);   /* lane 0: 0, lane 1: 4, ... */
    __m512i lo = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), sh);
    __m512i hi = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(b, b)), sh);
    *w0 = (v16)_mm512_permutexvar_ps(lo, (__m512)t);
    *w1 = (v16)_mm512_permutexvar_ps(hi, (__m512)t);
}
#else
typedef uint8_t u8v16 __attribute__((vector_size(16), aligned(1)));
static inline v16 fp4_tab(float s) { return bc(s); }
/* e2m1 codes (0..15 in int32 lanes) -> their values */
static inline v16 e2m1_vals(i16 c) {
    i16 mag = c & 7, sign = (c & 8) << 28;
    i16 normal = (mag << 22) + (126 << 23);
    i16 bits = ((mag >= 2) & normal) | ((mag == 1) & (126 << 23));
    return (v16)(bits | sign);
}
static inline void dec32(const uint8_t *p, v16 t, v16 *w0, v16 *w1) {
    u8v16 b;
    memcpy(&b, p, 16);
    i16 c = __builtin_convertvector(b, i16);
    v16 ev = e2m1_vals(c & 15) * t, od = e2m1_vals(c >> 4) * t;   /* columns 2j, 2j+1 of byte j */
    *w0 = SHUF(ev, od, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    *w1 = SHUF(ev, od, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}
#endif

#define XV(j, k) ld(x + (j) * ldx + (k))

/* part[j] (16 lanes whose sum is x[j] . w) for MB (1-3) rows of x against weight row wr, its scales sr */
#define FROW(MB)                                                                                   \
static inline void frow4_##MB(const float *x, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K, \
                              v16 *part, const uint8_t *pf) {                                      \
    v16 a0 = bc(0), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;                                   \
    for (int64_t k = 0; k < K; k += 32) {                                                          \
        if (pf && !(k & 127)) __builtin_prefetch(pf + k / 2, 0, 2);                                \
        v16 w0, w1;                                                                                \
        dec32(wr + k / 2, fp4_tab(e8m0(sr[k / 32])), &w0, &w1);                                    \
        a0 += w0 * XV(0, k); b0 += w1 * XV(0, k + 16);                                             \
        if (MB > 1) { a1 += w0 * XV(1, k); b1 += w1 * XV(1, k + 16); }                             \
        if (MB > 2) { a2 += w0 * XV(2, k); b2 += w1 * XV(2, k + 16); }                             \
    }                                                                                              \
    part[0] = a0 + b0;                                                                             \
    if (MB > 1) part[1] = a1 + b1;                                                                 \
    if (MB > 2) part[2] = a2 + b2;                                                                 \
}
FROW(1) FROW(2) FROW(3)
#undef FROW

#define FOUT(j, c0, c1, c2, c3)                                                                    \
    { v16 t = reduce4(c0, c1, c2, c3); for (int r = 0; r < 4; r++) y[(j) * ldy + r] = t[4 * r]; }
#define ACC(j, c0, c1, c2, c3)                                                                     \
    { v16 xa = XV(j, k), xb = XV(j, k + 16);                                                       \
      c0 += w00 * xa + w01 * xb; c1 += w10 * xa + w11 * xb; c2 += w20 * xa + w21 * xb; c3 += w30 * xa + w31 * xb; }
/* y[j, 0..3] (rows ldy apart) for 4 weight rows (ldw apart; scale rows lds apart) x MB (1-4) rows of x */
#define FBLOCK(MB)                                                                                 \
static void fblock4_##MB(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s,   \
                         int64_t lds, float *y, int64_t ldy, int64_t K, int pf) {                  \
    v16 c00 = bc(0), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;  \
    v16 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;    \
    for (int64_t k = 0; k < K; k += 32) {                                                          \
        if (pf && !(k & 127)) for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + k / 2, 0, 2); \
        v16 w00, w01, w10, w11, w20, w21, w30, w31;                                                \
        dec32(w + k / 2, fp4_tab(e8m0(s[k / 32])), &w00, &w01);                                    \
        dec32(w + ldw + k / 2, fp4_tab(e8m0(s[lds + k / 32])), &w10, &w11);                        \
        dec32(w + 2 * ldw + k / 2, fp4_tab(e8m0(s[2 * lds + k / 32])), &w20, &w21);                \
        dec32(w + 3 * ldw + k / 2, fp4_tab(e8m0(s[3 * lds + k / 32])), &w30, &w31);                \
        KEEP(w00); KEEP(w01); KEEP(w10); KEEP(w11); KEEP(w20); KEEP(w21); KEEP(w30); KEEP(w31);    \
        ACC(0, c00, c01, c02, c03)                                                                 \
        if (MB > 1) ACC(1, c10, c11, c12, c13)                                                     \
        if (MB > 2) ACC(2, c20, c21, c22, c23)                                                     \
        if (MB > 3) ACC(3, c30, c31, c32, c33)                                                     \
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
                           int64_t, int64_t, int);
static const fblock4_fn fblock4[5] = {NULL, fblock4_1, fblock4_2, fblock4_3, fblock4_4};

static inline float hsum(v16 v) {
    float t = 0;
    for (int l = 0; l < 16; l++) t += v[l];
    return t;
}

static inline void frow4(int64_t mb, const float *x, int64_t ldx, const uint8_t *wr, const uint8_t *sr, int64_t K,
                         v16 *part, const uint8_t *pf) {
    if (mb == 1) frow4_1(x, ldx, wr, sr, K, part, pf);
    else if (mb == 2) frow4_2(x, ldx, wr, sr, K, part, pf);
    else frow4_3(x, ldx, wr, sr, K, part, pf);
}

/* y [M, N] (rows ldy apart) = x [M, K] @ W^T, W [N, K] = w (e2m1 pairs, rows ldw bytes apart) times its e8m0
   scales s ([N, K/32], rows lds apart). K % 32 == 0. */
void linear_fp4(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds,
                float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t n4 = N & ~(int64_t)3;
    if (M < 4) {
        v16 part[4][3];
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) {   /* the row 4 ahead asked into L2 as this one streams */
                const uint8_t *wr = w + (n + r) * ldw, *pf = n + r + 4 < N ? wr + 4 * ldw : NULL;
                frow4(M, x, ldx, wr, s + (n + r) * lds, K, part[r], pf);
            }
            for (int64_t j = 0; j < M; j++) {
                v16 t = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = t[4 * r];
            }
        }
        for (int64_t n = n4; n < N; n++) {
            frow4(M, x, ldx, w + n * ldw, s + n * lds, K, part[0], NULL);
            for (int64_t j = 0; j < M; j++) y[j * ldy + n] = hsum(part[0][j]);
        }
        return;
    }
    for (int64_t n = 0; n < n4; n += 4)
        for (int64_t m = 0; m < M;) {
            int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
            fblock4[mb](x + m * ldx, ldx, w + n * ldw, ldw, s + n * lds, lds, y + m * ldy + n, ldy, K,
                        m == 0 && n + 8 <= N);
            m += mb;
        }
    for (int64_t n = n4; n < N; n++)
        for (int64_t m = 0; m < M; m += 3) {
            v16 part[3];
            int64_t mb = M - m < 3 ? M - m : 3;
            frow4(mb, x + m * ldx, ldx, w + n * ldw, s + n * lds, K, part, NULL);
            for (int64_t j = 0; j < mb; j++) y[(m + j) * ldy + n] = hsum(part[j]);
        }
}

/* out [N, K] (rows ldo apart, float32 or bfloat16: odt) = the dequantised weight, for the big-batch GEMMs
   (prefill), which run on BLAS over a dequantised copy */
static void fp4_dequant(const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds, int64_t N, int64_t K,
                        void *out, int64_t ldo, int64_t odt) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k += 32) {
            v16 v[2];
            dec32(w + n * ldw + k / 2, fp4_tab(e8m0(s[n * lds + k / 32])), &v[0], &v[1]);
            for (int h = 0; h < 2; h++) {
                if (odt == WD_BF16)
                    for (int l = 0; l < 16; l++) ((uint16_t *)out)[n * ldo + k + 16 * h + l] = to_bf16(v[h][l]);
                else
                    st((float *)out + n * ldo + k + 16 * h, v[h]);
            }
        }
}

int64_t wd_linear_fp4(const wd_linear_fp4_args *a) {
    if (a->K % 32 || a->K < 0) return -1;
    if (a->x == NULL) fp4_dequant(a->w, a->ldw, a->s, a->lds, a->N, a->K, a->y, a->ldy, a->odt);
    else linear_fp4(a->x, a->ldx, a->w, a->ldw, a->s, a->lds, a->y, a->ldy, a->M, a->N, a->K);
    return 0;
}
