/* mla_decode.c's vector loops (the fp8 / fp4 rows' dequantisation, the softmax, the weighted sum of the rows) for
   CPUs with AVX2 + FMA and no AVX-512, on 8-float __m256 intrinsics, as gemm_avx2.c is gemm.c's; the scores are
   the GEMMs' (linear, linear_bf16: gemm_avx2.c's there). mla_decode.c's 16-float vectors are two ymm registers
   each there and GCC lowered them through the stack (GCC 12, -march=x86-64-v3: 100 of its 136 FMAs read an
   operand from the stack, 213 of its 314 ymm moves went through it). Here every vector is one register and no
   loop keeps more than 16 live (the same build: none of its 96 FMAs reads the stack, none of its 128 ymm moves goes
   through it; mla_decode.c keeps no vector code then). GCC had also turned the 16-wide e4m3 widening into
   byte-by-byte code: the fp8 cache was the slowest. Measured on the Intel Xeon, x86-64-v3 build of each, one
   thread, C 512 + R 64, 16 heads, blocks of 64, medians of 5 interleaved calls (noisy: tests on the other core),
   float32 / bfloat16 / fp8 cache, ms: B 1 L 512 0.63 / 0.65 / 5.76 -> 0.22 / 0.27 / 0.31; B 16 L 4096 225 / 198 /
   443 -> 97 / 86 / 82; 128 heads, B 8 L 512 80 / 88 / 144 -> 30 / 32 / 47.

   The same values as mla_decode.c: e4m3 bytes by the same integer trick (exponent and mantissa bits at the top
   of a float32's, the value times 2^-120, then one multiply by scale * 2^120), e2m1 codes by the same table
   (a lane permute) times the same scalar group scale, bfloat16 widened exactly, the softmax's exp by wideep.h's
   vexp polynomial on the same elements (16 at a time, expf on the rest) with the 1 / sum last; float32 sums, in
   another order. Weighted sum: tiles of 4 heads x 3 vectors of 8 columns, 12 accumulators + 3 row vectors + the
   broadcast score = 16 registers, each row's vectors loaded once for the 4 heads; 1 head and 1-2 vectors at the
   edges, the columns past the last multiple of 8 one at a time. Compiled only where wideep.h's WD_AVX2 says so;
   elsewhere this file is empty. */
#include "wideep.h"

#if WD_AVX2
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

AI float e4m3(uint8_t b, float scale) {   /* mla_decode.c's scalar one */
    uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * scale;
}

/* 8 e4m3 bytes at p times sv (the group's scale times 2^120) */
AI __m256 e4m3x8(const uint8_t *p, __m256 sv) {
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24),
                                   _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7f)), 20));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), sv);
}

AI __m256 ld_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the RoPE part of a packed row: n values of dtype rdt (float32, or WD_BF16) at r, as floats o */
AI void rope_part(const uint8_t *r, int64_t rdt, int64_t n, float *o) {
    if (rdt != WD_BF16) {
        memcpy(o, r, n * sizeof(float));
        return;
    }
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(o + c, ld_bf16x8((const uint16_t *)(r + 2 * c)));
    for (; c < n; c++) {
        uint16_t b;
        memcpy(&b, r + 2 * c, 2);
        o[c] = from_bf16(b);
    }
}

/* mla_decode.c's fp8_rows: rows [first, first + n) of a packed fp8 pool as floats kb [n, D] */
const float *fp8_rows_avx2(const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t rdt, int64_t group,
                           int64_t C, int64_t D, int64_t first, int64_t n, float *kb) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = pool8 + (first + i) * W;
        float *o = kb + i * D;
        for (int64_t g = 0; g < C; g += group) {
            float sg;
            memcpy(&sg, r + soff + g / group * 4, 4);
            sg *= 0x1p120f;
            __m256 sv = _mm256_set1_ps(sg);
            int64_t c = g;
            for (; c + 8 <= g + group; c += 8) _mm256_storeu_ps(o + c, e4m3x8(r + c, sv));
            for (; c < g + group; c++) o[c] = e4m3(r[c], sg);
        }
        rope_part(r + roff, rdt, D - C, o + C);
    }
    return kb;
}

/* mla_decode.c's fp4_rows: E2M1[code] (a permute over the 8 magnitudes, the code's bit 3 the sign) times the
   group's scale, 8 values (4 bytes) at a time */
const float *fp4_rows_avx2(const uint8_t *pool8, int64_t W, int64_t soff, int64_t toff, int64_t roff, int64_t rdt,
                           int64_t C, int64_t D, int64_t first, int64_t n, float *kb) {
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i nib = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);   /* value 2k: byte k's low nibble */
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = pool8 + (first + i) * W;
        float *o = kb + i * D, tok;
        memcpy(&tok, r + toff, 4);
        for (int64_t g = 0; g < C / 16; g++) {
            __m256 sv = _mm256_set1_ps(e4m3(r[soff + g], 0x1p120f) * tok);
            for (int h = 0; h < 2; h++) {
                uint32_t u;
                memcpy(&u, r + 8 * g + 4 * h, 4);
                __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)u), nib), _mm256_set1_epi32(15));
                __m256 v = _mm256_permutevar8x32_ps(mag, code);   /* (the index's low 3 bits) */
                v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(code, 3), 31)));
                _mm256_storeu_ps(o + 16 * g + 8 * h, _mm256_mul_ps(v, sv));
            }
        }
        rope_part(r + roff, rdt, D - C, o + C);
    }
    return kb;
}

/* wideep.h's vexp on 8 lanes, the same operations in the same order, with the FMAs GCC contracts vexp's
   multiply-adds into (its default -ffp-contract=fast): the same values */
AI __m256 vexp8(__m256 x) {
    __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-87.33f);
    x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));   /* (a NaN stays one, as vexp's) */
    x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    __m256 big = _mm256_set1_ps(12582912.0f);
    __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), big), big);   /* round to nearest */
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* mla_decode.c's softmax_row: s[j] = exp((s[j] - max) * scale) for j < L; returns 1 / their sum */
float softmax_row_avx2(float *s, int64_t L, float scale) {
    float mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
    __m256 m = _mm256_set1_ps(mx), sc = _mm256_set1_ps(scale), a = _mm256_setzero_ps(), b = a;
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {   /* vexp on the same elements as mla_decode.c's */
        __m256 e0 = vexp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m), sc));
        __m256 e1 = vexp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), m), sc));
        _mm256_storeu_ps(s + j, e0);
        _mm256_storeu_ps(s + j + 8, e1);
        a = _mm256_add_ps(a, e0);
        b = _mm256_add_ps(b, e1);
    }
    float t[16];
    _mm256_storeu_ps(t, a);
    _mm256_storeu_ps(t + 8, b);
    for (int l = 0; l < 16; l++) sum += t[l];
    for (; j < L; j++) { s[j] = expf((s[j] - mx) * scale); sum += s[j]; }
    return 1.0f / sum;
}

/* o[h, :8 NV] += sum over the nj rows j of p[h * L + j] * row_j[:8 NV] for NH heads (rows D apart, scores L
   apart, outputs C apart); LDR: float32 or bfloat16 rows */
#define PV_TILE(NH, NV, SFX, RT, LDR)                                                                   \
AI void pv##SFX##_##NH##_##NV(const RT *rows, int64_t D, int64_t nj, const float *p, int64_t L, float *o, \
                              int64_t C) {                                                          \
    __m256 acc[NH][NV];                                                                             \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) acc[h][v] = _mm256_loadu_ps(o + h * C + 8 * v); \
    for (int64_t j = 0; j < nj; j++) {                                                              \
        __m256 r[NV];                                                                               \
        for (int v = 0; v < NV; v++) r[v] = LDR(rows + j * D + 8 * v);                              \
        for (int h = 0; h < NH; h++) {                                                              \
            __m256 pv = _mm256_broadcast_ss(p + h * L + j);                                         \
            for (int v = 0; v < NV; v++) acc[h][v] = _mm256_fmadd_ps(pv, r[v], acc[h][v]);          \
        }                                                                                           \
    }                                                                                               \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + h * C + 8 * v, acc[h][v]); \
}
PV_TILE(4, 3, , float, _mm256_loadu_ps) PV_TILE(4, 2, , float, _mm256_loadu_ps)
PV_TILE(4, 1, , float, _mm256_loadu_ps) PV_TILE(1, 3, , float, _mm256_loadu_ps)
PV_TILE(1, 2, , float, _mm256_loadu_ps) PV_TILE(1, 1, , float, _mm256_loadu_ps)
PV_TILE(4, 3, b, uint16_t, ld_bf16x8) PV_TILE(4, 2, b, uint16_t, ld_bf16x8) PV_TILE(4, 1, b, uint16_t, ld_bf16x8)
PV_TILE(1, 3, b, uint16_t, ld_bf16x8) PV_TILE(1, 2, b, uint16_t, ld_bf16x8) PV_TILE(1, 1, b, uint16_t, ld_bf16x8)
#undef PV_TILE

/* the tiles of one kind of row (SFX: float32 or b, bfloat16) over the columns c0 .. C8 (3, then 2 or 1
   vectors) and the heads (4, then 1) */
#define PV_ALL(SFX, rows)                                                                               \
    for (int64_t c0 = 0, nv; c0 < C8; c0 += 8 * nv) {                                                   \
        nv = C8 - c0 >= 24 ? 3 : (C8 - c0) / 8;                                                         \
        for (int64_t n0 = 0, four; n0 < Nh; n0 += four ? 4 : 1) {                                       \
            four = Nh - n0 >= 4;                                                                        \
            const float *pp = p + n0 * L;                                                               \
            float *oo = o + n0 * C + c0;                                                                \
            if (four) {                                                                                 \
                if (nv == 3) pv##SFX##_4_3(rows + c0, D, nj, pp, L, oo, C);                             \
                else if (nv == 2) pv##SFX##_4_2(rows + c0, D, nj, pp, L, oo, C);                        \
                else pv##SFX##_4_1(rows + c0, D, nj, pp, L, oo, C);                                     \
            } else if (nv == 3) pv##SFX##_1_3(rows + c0, D, nj, pp, L, oo, C);                          \
            else if (nv == 2) pv##SFX##_1_2(rows + c0, D, nj, pp, L, oo, C);                            \
            else pv##SFX##_1_1(rows + c0, D, nj, pp, L, oo, C);                                         \
        }                                                                                               \
    }

/* mla_decode.c's pv_rows: o [Nh, C] += p [Nh, nj] (rows L apart) @ the nj rows (D apart; float32 blk, or
   bfloat16 blk16 where blk is NULL)[:, :C] */
void pv_rows_avx2(const float *blk, const uint16_t *blk16, int64_t D, int64_t nj, const float *p, int64_t L,
                  float *o, int64_t C, int64_t Nh) {
    int64_t C8 = C & ~(int64_t)7;
    if (blk16) PV_ALL(b, blk16)
    else PV_ALL(, blk)
    for (int64_t j = 0; j < nj; j++)
        for (int64_t n = 0; n < Nh; n++)
            for (int64_t c = C8; c < C; c++)
                o[n * C + c] += p[n * L + j] * (blk16 ? from_bf16(blk16[j * D + c]) : blk[j * D + c]);
}
#undef PV_ALL

#endif
