/* The streamed GEMM for FP8 block-quantised weights (cpu/gemm.py linear_fp8, the routed experts of an fp8
   checkpoint): w [N, K] float8_e4m3fn bytes with one float32 scale per br x bk block (DeepSeek-V3's
   `weight_scale_inv` [ceil(N/br), ceil(K/bk)], rows lds apart), kept as stored. Each 16 weights are widened
   to float32 in registers as they stream in and multiplied by their block's scale, which is exactly
   dequantize_fp8_block's float32 value (moe/fp8.py): the sums are the float32 GEMM's on the dequantised
   weights, up to the order of the additions. Activations and sums float32.

   Why: decode streams every weight once a step, so its time is the bytes it reads; one byte a weight
   is a quarter of float32's and half of bfloat16's. The conversion costs a handful of vector operations
   per 16 weights, cheaper than the memory it saves on one core (bench/bf16_gemm.py --fp8 measures it).
   The loops are gemm.c's: one to three rows of x read each weight row once, front to back, with two
   accumulators a row; four or more rows run blocks of 4 weight rows x up to 4 rows of x that share
   every load. bk must be a multiple of 16 (one vector never straddles two blocks; the launcher checks);
   N, K and br are free (partial edge blocks, K's tail masked).

   e4m3 -> float32: on AVX-512 the byte is moved into a float16 whose exponent field is the e4m3 one
   (bias 15 instead of 7: the value times 2^-8) and widened by vcvtph2ps, which handles the e4m3
   subnormals as float16 subnormals exactly; the 2^8 is folded into the scale (with AVX2 and no AVX-512,
   gemm_fp8_avx2.c's GEMM does the same with F16C, and this file keeps only the dequantiser). Elsewhere: integer
   operations (normals rebiased, subnormals as m * 2^-9 by int -> float). Bytes 0x7f / 0xff (e4m3's NaN,
   which no quantiser writes: moe/fp8.py clamps to +-448) read as +-480. */
#include "wideep.h"

#ifdef __AVX512F__
/* 16 e4m3 bytes at p -> their values times 2^-8 (exact) */
static inline v16 ld_e4m3(const uint8_t *p) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), _mm256_set1_epi16((short)0xbfff));
    return (v16)_mm512_cvtph_ps(h);
}
#define E4M3_UNIT 256.0f   /* what ld_e4m3's values are to be multiplied by */
#else
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
static inline v16 ld_e4m3(const uint8_t *p) {
    u8x16 b;
    memcpy(&b, p, 16);
    i16 w = __builtin_convertvector(b, i16), mag = w & 0x7f, sign = (w & 0x80) << 24;
    i16 normal = (mag << 20) + (120 << 23);
    v16 sub = __builtin_convertvector(mag, v16) * bc(1.0f / 512);
    i16 bits = ((mag >= 8) & normal) | (~(mag >= 8) & (i16)sub);
    return (v16)(bits | sign);
}
#define E4M3_UNIT 1.0f
#endif
#define ldv ld

/* the first n (< 16) weights at p, zero-padded (never reading past p + n) */
static inline v16 ld_e4m3_part(const uint8_t *p, int64_t n) {
    uint8_t t[16] = {0};
    memcpy(t, p, n);
    return ld_e4m3(t);
}

/* a few rows of x and more on AMX tiles where they are on and the shapes fit (gemm_fp8_amx.c) */
#define FP8_TILES(...) \
    if (M >= FP8_AMX_MIN_ROWS && amx_on() && linear_fp8_amx(__VA_ARGS__)) return

#if WD_AVX2   /* 8-float vectors instead (gemm_fp8_avx2.c): 16-float ones spill without AVX-512 */
void linear_fp8(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    FP8_TILES(x, ldx, w, ldw, s, lds, br, bk, y, ldy, M, N, K);
    linear_fp8_avx2(x, ldx, w, ldw, s, lds, br, bk, y, ldy, M, N, K);
}
#else

/* The accumulators are named variables, not arrays: with the loop over blocks around the loop over K, GCC
   kept arrays of them on the stack, loading and storing one around every FMA (measured: 1 row of 4096 x 4096
   ran at a quarter of the bfloat16 kernel's speed). The `if (MB > j)` are constants: each instance keeps
   only its rows. */
#define XV(j, k) ldv(x + (j) * ldx + (k))
#define XP(j, k) ld_part(x + (j) * ldx + (k), k1 - (k))

/* part[j] (16 lanes whose sum is x[j] . w) for MB (1-3) rows of x against weight row wr, its block scales sr;
   two accumulators a row (two dependency chains) */
#define FROW(MB)                                                                                   \
static inline void frow_##MB(const float *x, int64_t ldx, const uint8_t *wr, const float *sr, int64_t bk, \
                             int64_t K, v16 *part, const uint8_t *pf) {                            \
    v16 a0 = bc(0), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;                                   \
    for (int64_t k0 = 0; k0 < K; k0 += bk) {                                                       \
        v16 sv = bc(sr[k0 / bk] * E4M3_UNIT);                                                      \
        int64_t k1 = k0 + bk < K ? k0 + bk : K, k16 = k0 + ((k1 - k0) & ~(int64_t)15), k = k0;     \
        for (; k + 64 <= k16; k += 64) {   /* a cache line of weights a step */                   \
            if (pf) __builtin_prefetch(pf + k, 0, 2);                                              \
            v16 w0 = ld_e4m3(wr + k) * sv, w1 = ld_e4m3(wr + k + 16) * sv;                         \
            v16 w2 = ld_e4m3(wr + k + 32) * sv, w3 = ld_e4m3(wr + k + 48) * sv;                    \
            a0 += w0 * XV(0, k); b0 += w1 * XV(0, k + 16); a0 += w2 * XV(0, k + 32); b0 += w3 * XV(0, k + 48); \
            if (MB > 1) { a1 += w0 * XV(1, k); b1 += w1 * XV(1, k + 16);                           \
                          a1 += w2 * XV(1, k + 32); b1 += w3 * XV(1, k + 48); }                    \
            if (MB > 2) { a2 += w0 * XV(2, k); b2 += w1 * XV(2, k + 16);                           \
                          a2 += w2 * XV(2, k + 32); b2 += w3 * XV(2, k + 48); }                    \
        }                                                                                          \
        if (pf && k < k1) __builtin_prefetch(pf + k, 0, 2);                                        \
        for (; k + 32 <= k16; k += 32) {                                                           \
            v16 w0 = ld_e4m3(wr + k) * sv, w1 = ld_e4m3(wr + k + 16) * sv;                         \
            a0 += w0 * XV(0, k); b0 += w1 * XV(0, k + 16);                                         \
            if (MB > 1) { a1 += w0 * XV(1, k); b1 += w1 * XV(1, k + 16); }                         \
            if (MB > 2) { a2 += w0 * XV(2, k); b2 += w1 * XV(2, k + 16); }                         \
        }                                                                                          \
        if (k < k16) {                                                                             \
            v16 w0 = ld_e4m3(wr + k) * sv;                                                         \
            a0 += w0 * XV(0, k);                                                                   \
            if (MB > 1) a1 += w0 * XV(1, k);                                                       \
            if (MB > 2) a2 += w0 * XV(2, k);                                                       \
            k += 16;                                                                               \
        }                                                                                          \
        if (k < k1) {   /* only at the end of K: bk is a multiple of 16 */                         \
            v16 w0 = ld_e4m3_part(wr + k, k1 - k) * sv;                                            \
            a0 += w0 * XP(0, k);                                                                   \
            if (MB > 1) a1 += w0 * XP(1, k);                                                       \
            if (MB > 2) a2 += w0 * XP(2, k);                                                       \
        }                                                                                          \
    }                                                                                              \
    part[0] = a0 + b0;                                                                             \
    if (MB > 1) part[1] = a1 + b1;                                                                 \
    if (MB > 2) part[2] = a2 + b2;                                                                 \
}
FROW(1) FROW(2) FROW(3)
#undef FROW

/* y[j, 0..3] (rows ldy apart) for 4 weight rows (scale rows s0..s3) x MB (1-4) rows of x: every load shared
   by the 4 MB accumulators */
#define FBLOCK_STEP(MB, LDX, LDWV)                                                                 \
    {                                                                                              \
        v16 w0 = LDWV(w + k) * v0, w1 = LDWV(w + ldw + k) * v1, w2 = LDWV(w + 2 * ldw + k) * v2,  \
            w3 = LDWV(w + 3 * ldw + k) * v3;                                                       \
        KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3);                                                    \
        { v16 xv = LDX(0, k); c00 += w0 * xv; c01 += w1 * xv; c02 += w2 * xv; c03 += w3 * xv; }    \
        if (MB > 1) { v16 xv = LDX(1, k); c10 += w0 * xv; c11 += w1 * xv; c12 += w2 * xv; c13 += w3 * xv; } \
        if (MB > 2) { v16 xv = LDX(2, k); c20 += w0 * xv; c21 += w1 * xv; c22 += w2 * xv; c23 += w3 * xv; } \
        if (MB > 3) { v16 xv = LDX(3, k); c30 += w0 * xv; c31 += w1 * xv; c32 += w2 * xv; c33 += w3 * xv; } \
    }
#define LDW_FULL(p) ld_e4m3(p)
#define LDW_TAIL(p) ld_e4m3_part(p, k1 - k)
#define FOUT(j, c0, c1, c2, c3)                                                                    \
    { v16 t = reduce4(c0, c1, c2, c3); for (int r = 0; r < 4; r++) y[(j) * ldy + r] = t[4 * r]; }
#define FBLOCK(MB)                                                                                 \
static void fblock_##MB(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s0,     \
                        const float *s1, const float *s2, const float *s3, int64_t bk, float *y, int64_t ldy, \
                        int64_t K, int pf) {                                                       \
    v16 c00 = bc(0), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;  \
    v16 c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;    \
    for (int64_t k0 = 0; k0 < K; k0 += bk) {                                                       \
        int64_t kb = k0 / bk, k1 = k0 + bk < K ? k0 + bk : K, k16 = k0 + ((k1 - k0) & ~(int64_t)15), k = k0; \
        v16 v0 = bc(s0[kb] * E4M3_UNIT), v1 = bc(s1[kb] * E4M3_UNIT), v2 = bc(s2[kb] * E4M3_UNIT),  \
            v3 = bc(s3[kb] * E4M3_UNIT);                                                           \
        if (pf)   /* the next 4 weight rows asked into L2 as these stream: a cache line of each per 4 steps */ \
            for (; k < k16; k += 16) {                                                             \
                if (!((k - k0) & 63)) for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + k, 0, 2); \
                FBLOCK_STEP(MB, XV, LDW_FULL)                                                      \
            }                                                                                      \
        else                                                                                       \
            for (; k < k16; k += 16) FBLOCK_STEP(MB, XV, LDW_FULL)                                 \
        if (k < k1) FBLOCK_STEP(MB, XP, LDW_TAIL)                                                  \
    }                                                                                              \
    FOUT(0, c00, c01, c02, c03)                                                                    \
    if (MB > 1) FOUT(1, c10, c11, c12, c13)                                                        \
    if (MB > 2) FOUT(2, c20, c21, c22, c23)                                                        \
    if (MB > 3) FOUT(3, c30, c31, c32, c33)                                                        \
}
FBLOCK(1) FBLOCK(2) FBLOCK(3) FBLOCK(4)
#undef FBLOCK
#undef FBLOCK_STEP
#undef FOUT
#undef LDW_FULL
#undef LDW_TAIL

typedef void (*fblock_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, const float *,
                          const float *, const float *, int64_t, float *, int64_t, int64_t, int);
static const fblock_fn fblock[5] = {NULL, fblock_1, fblock_2, fblock_3, fblock_4};

static inline float hsum(v16 v) {
    float t = 0;
    for (int l = 0; l < 16; l++) t += v[l];
    return t;
}

/* y [M, N] (rows ldy apart) = x [M, K] @ W^T, W [N, K] = w (e4m3, rows ldw apart) * its block scales s
   ([ceil(N/br), ceil(K/bk)], rows lds apart). bk % 16 == 0. */
void linear_fp8(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    FP8_TILES(x, ldx, w, ldw, s, lds, br, bk, y, ldy, M, N, K);
    int64_t n4 = N & ~(int64_t)3;
    if (M < 4) {
        v16 part[4][3];
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) {   /* the row 4 ahead asked into L2 as this one streams */
                const uint8_t *wr = w + (n + r) * ldw, *pf = n + r + 4 < N ? wr + 4 * ldw : NULL;
                const float *sr = s + (n + r) / br * lds;
                if (M == 1) frow_1(x, ldx, wr, sr, bk, K, part[r], pf);
                else if (M == 2) frow_2(x, ldx, wr, sr, bk, K, part[r], pf);
                else frow_3(x, ldx, wr, sr, bk, K, part[r], pf);
            }
            for (int64_t j = 0; j < M; j++) {
                v16 t = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = t[4 * r];
            }
        }
        for (int64_t n = n4; n < N; n++) {
            const uint8_t *wr = w + n * ldw;
            const float *sr = s + n / br * lds;
            if (M == 1) frow_1(x, ldx, wr, sr, bk, K, part[0], NULL);
            else if (M == 2) frow_2(x, ldx, wr, sr, bk, K, part[0], NULL);
            else frow_3(x, ldx, wr, sr, bk, K, part[0], NULL);
            for (int64_t j = 0; j < M; j++) y[j * ldy + n] = hsum(part[0][j]);
        }
        return;
    }
    for (int64_t n = 0; n < n4; n += 4) {
        const float *s0 = s + n / br * lds, *s1 = s + (n + 1) / br * lds, *s2 = s + (n + 2) / br * lds,
                    *s3 = s + (n + 3) / br * lds;
        for (int64_t m = 0; m < M;) {
            int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
            fblock[mb](x + m * ldx, ldx, w + n * ldw, ldw, s0, s1, s2, s3, bk, y + m * ldy + n, ldy, K,
                       m == 0 && n + 8 <= N);
            m += mb;
        }
    }
    for (int64_t n = n4; n < N; n++) {
        const uint8_t *wr = w + n * ldw;
        const float *sr = s + n / br * lds;
        for (int64_t m = 0; m < M; m += 3) {
            v16 part[3];
            int64_t mb = M - m < 3 ? M - m : 3;
            if (mb == 1) frow_1(x + m * ldx, ldx, wr, sr, bk, K, part, NULL);
            else if (mb == 2) frow_2(x + m * ldx, ldx, wr, sr, bk, K, part, NULL);
            else frow_3(x + m * ldx, ldx, wr, sr, bk, K, part, NULL);
            for (int64_t j = 0; j < mb; j++) y[(m + j) * ldy + n] = hsum(part[j]);
        }
    }
}

#endif

/* out [N, K] (rows ldo apart, float32 or bfloat16: odt) = the dequantised weight, for the big-batch GEMMs
   (prefill), which run on BLAS over a dequantised copy: their work per weight is high enough that
   widening each weight once for the whole batch costs nothing next to them */
static void fp8_dequant(const uint8_t *w, int64_t ldw, const float *s, int64_t lds, int64_t br, int64_t bk,
                        int64_t N, int64_t K, void *out, int64_t ldo, int64_t odt) {
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * ldw;
        const float *sr = s + n / br * lds;
        float *of = (float *)out + n * ldo;
        uint16_t *ob = (uint16_t *)out + n * ldo;
        for (int64_t k = 0; k < K; k += 16) {
            int64_t m = K - k < 16 ? K - k : 16;
            v16 v = (m == 16 ? ld_e4m3(wr + k) : ld_e4m3_part(wr + k, m)) * bc(sr[k / bk] * E4M3_UNIT);
            if (odt == WD_BF16) for (int64_t l = 0; l < m; l++) ob[k + l] = to_bf16(v[l]);
            else if (m == 16) st(of + k, v);
            else for (int64_t l = 0; l < m; l++) of[k + l] = v[l];
        }
    }
}

int64_t wd_linear_fp8(const wd_linear_fp8_args *a) {
    if (a->bk <= 0 || a->bk % 16 || a->br <= 0) return -1;
    if (a->x == NULL) fp8_dequant(a->w, a->ldw, a->s, a->lds, a->br, a->bk, a->N, a->K, a->y, a->ldy, a->odt);
    else linear_fp8(a->x, a->ldx, a->w, a->ldw, a->s, a->lds, a->br, a->bk, a->y, a->ldy, a->M, a->N, a->K);
    return 0;
}
