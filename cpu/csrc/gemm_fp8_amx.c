/* The FP8 block-quantised GEMM (gemm_fp8.c's linear_fp8) on AMX tiles, for a few rows of x and more.

   Why: gemm_fp8.c widens every weight to float32 and multiplies on 16-lane FMAs. At one to three rows of x that
   streams at the memory's speed; at 16 rows (a decode step of 16 sequences, a routed expert's rows) it is bound by
   the FMAs, about 32 products a cycle. A TDPBF16PS does 16 x 16 x 32 products in about 16 cycles, so here each
   weight is widened once, to bfloat16 (exact: e4m3 has 3 mantissa bits and a narrower exponent), into a tile, and
   every row of x meets it there.

   Exact enough to stand in for linear_fp8 whatever the model's dtype: x is not just rounded to bfloat16. Each row
   is split into up to SPLIT bfloat16 parts (the rounding of x, then of what is left, ...), every part is a row of the B
   tiles, and y is the sum of the parts' sums. The products are exact in float32; the block scales are applied in
   float32 to each block's sums (a scale per br x bk block: a tile's 16 weight rows and 32 features lie in one block
   when br % 16 == 0 and bk % 32 == 0). So the result is linear_fp8's up to float32 rounding of the sums.

   Loops: the weights 32 rows (two A tiles) at a time; per scale block of bk features, those rows are widened into
   scratch (bk/32 steps x 2 tiles x 1 KiB) while the next 32 rows' lines of the same features are asked into L2,
   then every 32 rows of x's parts pass over them: tiles zeroed, bk/32 steps, the 4 sums stored and added, scaled,
   into float32 accumulators [32 weight rows][P * M rows]. At the end y = the parts' sums added.
   Taken only where the shapes fit (otherwise linear_fp8 runs as before): K % 32 == 0, N % 16 == 0, br % 16 == 0,
   bk % 32 == 0 and FP8_AMX_MIN_ROWS <= M <= FP8_AMX_MAX_ROWS. */
#include <stdlib.h>

#include "wideep.h"

#if WD_AMX
#include "amx.h"

/* the most bfloat16 parts x is split into: three leave |x - their sum| <= 2^-27 |x| (two leave 2^-18: visible at
   1e-5 in a float32 model's MLP, tests/cpu/test_fused.py) */
#define SPLIT 3

/* the e4m3 bytes p[0..31] as 32 bfloat16 with the same values: normals rebiased (exponent +120, mantissa << 4),
   subnormals (m * 2^-9, m < 8) from a table; bytes 0x7f / 0xff (e4m3's NaN, which no quantiser writes) read as
   +-480 as gemm_fp8.c reads them */
static inline AMXF __m512i e4m3_bf16(const uint8_t *p) {
    const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
    v = _mm512_mask_mov_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), _mm512_permutexvar_epi16(mag, sub));
    return _mm512_or_si512(v, _mm512_and_si512(_mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000)));
}

/* bfloat16 -> float32 of the 32 values in v (a shift: exact) */
static inline AMXF __m512 bf_lo(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
static inline AMXF __m512 bf_hi(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

/* Fewer parts where fewer are exact: a bfloat16 model's activations are bfloat16 values, one part each (a third of
   the tile work, the same sums). -> how many parts make x exactly (1..SPLIT): the first whose remainder is zero in
   every element. */
static AMXF int parts_needed(const float *x, int64_t ldx, int64_t M, int64_t K) {
    __mmask16 left1 = 0, left2 = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 32) {
            const float *p = x + m * ldx + k;
            __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
            __m512i part = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            a = _mm512_sub_ps(a, bf_lo(part));
            b = _mm512_sub_ps(b, bf_hi(part));
            left1 |= _mm512_cmpneq_ps_mask(a, _mm512_setzero_ps()) | _mm512_cmpneq_ps_mask(b, _mm512_setzero_ps());
            part = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            a = _mm512_sub_ps(a, bf_lo(part));
            b = _mm512_sub_ps(b, bf_hi(part));
            left2 |= _mm512_cmpneq_ps_mask(a, _mm512_setzero_ps()) | _mm512_cmpneq_ps_mask(b, _mm512_setzero_ps());
        }
    return left2 ? 3 : left1 ? 2 : 1;
}

/* x [M, K] float32 -> xb: its P bfloat16 parts as rows p * M + m (part 0 the rounding of x, each next part the
   rounding of what the earlier ones left), zero rows up to a multiple of 16; per 16 rows and 32 features one
   1 KiB B tile [16 pairs][16 rows][2] */
static AMXF void pack_parts(const float *x, int64_t ldx, int64_t M, int64_t K, int P, uint16_t *xb) {
    int64_t MT = (P * M + 15) / 16, KB = K / 32;
    for (int64_t mt = 0; mt < MT; mt++)
        for (int64_t kb = 0; kb < KB; kb++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                int64_t m = mt * 16 + i;
                if (m >= P * M) {
                    r[i] = _mm512_setzero_si512();
                    continue;
                }
                const float *p = x + (m % M) * ldx + kb * 32;
                __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
                __m512i part = (__m512i)_mm512_cvtne2ps_pbh(b, a);
                for (int64_t k = 0; k < m / M; k++) {   /* what the earlier parts left (exact subtractions) */
                    a = _mm512_sub_ps(a, bf_lo(part));
                    b = _mm512_sub_ps(b, bf_hi(part));
                    part = (__m512i)_mm512_cvtne2ps_pbh(b, a);
                }
                r[i] = part;
            }
            tr16(r);
            uint16_t *t = xb + (mt * KB + kb) * 512;
            for (int p = 0; p < 16; p++) _mm512_store_si512(t + p * 32, r[p]);
        }
}

/* acc rows i0.. (16 weight rows, stride ldacc floats) at columns c0.. += scale * tile TILE's sums (stored through c) */
#define ACC(TILE, I0, C0, SC)                                                                        \
    do {                                                                                             \
        TILE_STORE(TILE, c, 64);                                                                     \
        __m512 sv_ = _mm512_set1_ps(SC);                                                             \
        for (int i_ = 0; i_ < 16; i_++) {                                                            \
            float *a_ = acc + ((I0) + i_) * ldacc + (C0);                                            \
            _mm512_store_ps(a_, _mm512_fmadd_ps(_mm512_load_ps(c + 16 * i_), sv_, _mm512_load_ps(a_)));   \
        }                                                                                            \
    } while (0)

AMXF int linear_fp8_amx(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                        int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (M < FP8_AMX_MIN_ROWS || M > FP8_AMX_MAX_ROWS || K % 32 || N % 16 || br % 16 || bk % 32 || !N || !K)
        return 0;
    int P = parts_needed(x, ldx, M, K);
    int64_t MT = (P * M + 15) / 16, KB = K / 32, SB = bk / 32, ldacc = MT * 16;
    /* scratch: x's B tiles, one scale block of 32 weight rows as A tiles, the accumulators */
    int64_t nxb = MT * KB * 512, nwa = SB * 2 * 512, nacc = 32 * ldacc * 2;   /* (uint16 units) */
    uint16_t *buf = amx_scratch(0, nxb + nwa + nacc);
    if (!buf) return 0;
    uint16_t *xb = buf, *wa = buf + nxb;
    float *acc = (float *)(wa + nwa);
    float c[256] __attribute__((aligned(64)));
    pack_parts(x, ldx, M, K, P, xb);
    tiles_on();
    for (int64_t n = 0; n < N; n += 32) {
        int two_a = n + 16 < N;
        int64_t rows = two_a ? 32 : 16;
        memset(acc, 0, (size_t)(rows * ldacc) * sizeof(float));
        const float *s0 = s + n / br * lds, *s1 = s + (n + 16) / br * lds;
        for (int64_t k0 = 0; k0 < K; k0 += bk) {
            int64_t steps = (K - k0 < bk ? K - k0 : bk) / 32;
            for (int64_t r = 0; r < rows; r++) {
                const uint8_t *wr = w + (n + r) * ldw + k0;
                if (n + 32 + r < N)   /* the next group's lines of these features, into L2 */
                    for (int64_t b = 0; b < steps * 32; b += 64) _mm_prefetch((const char *)(wr + 32 * ldw + b), _MM_HINT_T1);
                uint16_t *t = wa + (r / 16) * 512 + (r % 16) * 32;
                for (int64_t st = 0; st < steps; st++) _mm512_store_si512(t + st * 1024, e4m3_bf16(wr + st * 32));
            }
            float sc0 = s0[k0 / bk], sc1 = two_a ? s1[k0 / bk] : 0.0f;
            for (int64_t mt = 0; mt < MT; mt += 2) {
                int two_b = mt + 1 < MT;
                const uint16_t *b0 = xb + (mt * KB + k0 / 32) * 512, *b1 = b0 + KB * 512;
                TILES_ZERO4();
                for (int64_t st = 0; st < steps; st++)
                    TILE_STEP(wa + st * 1024, wa + st * 1024 + 512, 64, b0 + st * 512, b1 + st * 512, two_a, two_b);
                ACC(0, 0, mt * 16, sc0);
                if (two_a) ACC(1, 16, mt * 16, sc1);
                if (two_b) {
                    ACC(2, 0, mt * 16 + 16, sc0);
                    if (two_a) ACC(3, 16, mt * 16 + 16, sc1);
                }
            }
        }
        for (int64_t j = 0; j < M; j++)
            for (int64_t r = 0; r < rows; r++) {
                const float *a = acc + r * ldacc + j;
                float t = a[0];
                for (int p = 1; p < P; p++) t += a[p * M];
                y[j * ldy + n + r] = t;
            }
    }
    _tile_release();   /* the tiles back in their initial state (oneDNN configures its own) */
    amx_count(0);
    amx_count_parts(P);
    return 1;
}
#else
int linear_fp8_amx(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                   int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)ldx, (void)w, (void)ldw, (void)s, (void)lds, (void)br, (void)bk, (void)y, (void)ldy, (void)M;
    (void)N, (void)K;
    return 0;
}
#endif
