/* The absorbed MLA decode over the paged latent cache, float32, bfloat16 or packed fp8 rows (cpu/layers.py
   mla_decode): read through the block table, never gathered. */
#include "wideep.h"

#define FP8_ROWS 16   /* rows dequantised at a time: 16 x 576 floats stay in L1 */

#if WD_AVX2   /* 8-float vectors instead (mla_decode_avx2.c): 16-float ones spill without AVX-512 */
#define fp8_rows fp8_rows_avx2
#define fp4_rows fp4_rows_avx2
#define softmax_row softmax_row_avx2
#define pv_rows pv_rows_avx2
#else

/* e4m3 bytes -> float: the byte's exponent and mantissa bits placed at the top of a float32's exponent
   and mantissa give the value times 2^-120 (e4m3 subnormals land on float32 subnormals, exactly), so
   one shift and one multiply by scale * 2^120 dequantise; 16 at a time. (0x7f / 0xff, e4m3's NaN, read
   as +-480: the quantiser never writes them.) */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
static inline v16 e4m3x16(const uint8_t *p, v16 scale) {
    u8x16 b;
    memcpy(&b, p, 16);
    i16 w = __builtin_convertvector(b, i16);
    i16 bits = ((w & 0x80) << 24) | ((w & 0x7f) << 20);
    v16 f;
    memcpy(&f, &bits, 64);
    return f * scale;
}
static inline float e4m3(uint8_t b, float scale) {
    uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7f) << 20);
    float f;
    memcpy(&f, &bits, 4);
    return f * scale;
}

/* the RoPE part of a packed row: D - C values of dtype rdt (float32, or WD_BF16) at r, as floats o */
static inline void rope_part(const uint8_t *r, int64_t rdt, int64_t n, float *o) {
    if (rdt == WD_BF16)
        for (int64_t c = 0; c < n; c++) {
            uint16_t b;
            memcpy(&b, r + 2 * c, 2);
            o[c] = from_bf16(b);
        }
    else
        memcpy(o, r, n * sizeof(float));
}

/* e2m1 codes (sign << 3 | magnitude index) -> values */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Rows [first, first + n) of a packed fp4 pool (attention_mla/fp4_cache.py: W bytes a row, e2m1 codes of c [C]
   two a byte (value 2i low nibble), one e4m3 scale byte per 16 values at soff, the token's float32 scale at
   toff, k_pe [D - C] at roff of dtype rdt) as floats kb [n, D]: E2M1[code] * (e4m3 scale * token scale), the
   dequantiser's products in its order, so the values are the same floats. */
static const float *fp4_rows(const uint8_t *pool8, int64_t W, int64_t soff, int64_t toff, int64_t roff, int64_t rdt,
                             int64_t C, int64_t D, int64_t first, int64_t n, float *kb) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = pool8 + (first + i) * W;
        float *o = kb + i * D, tok;
        memcpy(&tok, r + toff, 4);
        for (int64_t g = 0; g < C / 16; g++) {
            float sg = e4m3(r[soff + g], 0x1p120f) * tok;
            v16 v;
            for (int k = 0; k < 8; k++) {
                uint8_t b = r[8 * g + k];
                v[2 * k] = E2M1[b & 15];
                v[2 * k + 1] = E2M1[b >> 4];
            }
            st(o + 16 * g, v * bc(sg));
        }
        rope_part(r + roff, rdt, D - C, o + C);
    }
    return kb;
}

/* Rows [first, first + n) of a packed fp8 pool (attention_mla/fp8_cache.py: W bytes a row, e4m3 c [C],
   float32 scales at soff, one per `group` values, k_pe [D - C] at roff, float32 or, rdt WD_BF16, bfloat16)
   as floats kb [n, D]. */
static const float *fp8_rows(const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t rdt, int64_t group,
                             int64_t C, int64_t D, int64_t first, int64_t n, float *kb) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = pool8 + (first + i) * W;
        float *o = kb + i * D;
        for (int64_t g = 0; g < C; g += group) {
            float sg;
            memcpy(&sg, r + soff + g / group * 4, 4);
            sg *= 0x1p120f;
            int64_t c = g;
            for (; c + 16 <= g + group; c += 16) st(o + c, e4m3x16(r + c, bc(sg)));
            for (; c < g + group; c++) o[c] = e4m3(r[c], sg);
        }
        rope_part(r + roff, rdt, D - C, o + C);
    }
    return kb;
}

/* o[h, :16 NV] += sum over the nj rows j of p[h * L + j] * row_j[:16 NV], for NH heads (rows D apart,
   heads' scores L apart, outputs C apart): a tile of NH x NV accumulators stays in registers for the
   whole run of rows, each row's vectors loaded once for all NH heads. */
#define PV_TILE(NH, NV, SFX, RT, LDR)                                                              \
static inline void pv##SFX##_##NH##_##NV(const RT *rows, int64_t D, int64_t nj, const float *p, int64_t L, \
                                         float *o, int64_t C) {                                    \
    v16 acc[NH][NV];                                                                               \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) acc[h][v] = ld(o + h * C + 16 * v);  \
    for (int64_t j = 0; j < nj; j++) {                                                             \
        v16 r[NV];                                                                                 \
        for (int v = 0; v < NV; v++) r[v] = LDR(rows + j * D + 16 * v);                            \
        for (int h = 0; h < NH; h++) {                                                             \
            v16 pv = bc(p[h * L + j]);                                                             \
            for (int v = 0; v < NV; v++) acc[h][v] += pv * r[v];                                   \
        }                                                                                          \
    }                                                                                              \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) st(o + h * C + 16 * v, acc[h][v]);   \
}
PV_TILE(4, 4, , float, ld) PV_TILE(4, 1, , float, ld) PV_TILE(1, 4, , float, ld) PV_TILE(1, 1, , float, ld)
/* the same over bfloat16 rows, widened as they are loaded */
PV_TILE(4, 4, b, uint16_t, ld_bf16) PV_TILE(4, 1, b, uint16_t, ld_bf16) PV_TILE(1, 4, b, uint16_t, ld_bf16)
PV_TILE(1, 1, b, uint16_t, ld_bf16)

/* s[j] = exp((s[j] - max) * scale) for j < L; returns 1 / their sum (the caller multiplies by it last) */
static float softmax_row(float *s, int64_t L, float scale) {
    float mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
    v16 acc = bc(0);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        v16 e = vexp((ld(s + j) - bc(mx)) * bc(scale));
        st(s + j, e);
        acc += e;
    }
    for (int l = 0; l < 16; l++) sum += acc[l];
    for (; j < L; j++) { s[j] = expf((s[j] - mx) * scale); sum += s[j]; }
    return 1.0f / sum;
}

/* o [Nh, C] += p [Nh, nj] (rows L apart) @ the nj rows (D apart; float32 blk, or bfloat16 blk16 where blk is
   NULL)[:, :C]: tiles of 4 or 1 heads x 64 or 16 columns, the columns past the last multiple of 16 one at a time */
static void pv_rows(const float *blk, const uint16_t *blk16, int64_t D, int64_t nj, const float *sp, int64_t L,
                    float *ob, int64_t C, int64_t Nh) {
    int64_t C16 = C & ~(int64_t)15, bf = blk16 != NULL;
    for (int64_t c0 = 0, wide; c0 < C16; c0 += wide ? 64 : 16) {
        wide = C16 - c0 >= 64;
        for (int64_t n0 = 0, four; n0 < Nh; n0 += four ? 4 : 1) {
            four = Nh - n0 >= 4;
            const float *p = sp + n0 * L;
            float *o = ob + n0 * C + c0;
            if (bf) {
                if (four && wide) pvb_4_4(blk16 + c0, D, nj, p, L, o, C);
                else if (four) pvb_4_1(blk16 + c0, D, nj, p, L, o, C);
                else if (wide) pvb_1_4(blk16 + c0, D, nj, p, L, o, C);
                else pvb_1_1(blk16 + c0, D, nj, p, L, o, C);
            } else if (four && wide) pv_4_4(blk + c0, D, nj, p, L, o, C);
            else if (four) pv_4_1(blk + c0, D, nj, p, L, o, C);
            else if (wide) pv_1_4(blk + c0, D, nj, p, L, o, C);
            else pv_1_1(blk + c0, D, nj, p, L, o, C);
        }
    }
    for (int64_t j = 0; j < nj; j++)
        for (int64_t n = 0; n < Nh; n++)
            for (int64_t c = C16; c < C; c++)
                ob[n * C + c] += sp[n * L + j] * (bf ? from_bf16(blk16[j * D + c]) : blk[j * D + c]);
}
#endif

/* Absorbed MLA decode over the paged latent cache, one query token per sequence: scores = q . latent
   over the sequence's blocks (read through the block table, never gathered), fp32 softmax, out =
   p @ latent[:, :C]. scratch: Nh * (max_len + 1) floats. pool8 (else NULL): the cache is packed fp8
   rows (fp4 0) or packed fp4 rows (fp4 1: group 16, the token scale at toff) instead of pool, and each block is dequantised into kb [bs, D] as it is read, once for the
   scores and once for the output. A bfloat16 pool (pdt WD_BF16) is read in place: the scores by the
   bfloat16 GEMM (linear_bf16: with the dot products on, q is rounded to bfloat16 for them), the output
   by tiles that widen each row as they load it (kb unused). Returns 0, or -1 (nothing computed) when a
   length is outside 1 .. max_len or a block id it needs is outside the pool. */
int64_t mla_decode(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const void *pool, int64_t pdt,
                   int64_t num_blocks,
                   const int64_t *table, int64_t max_blocks, const int32_t *lens, int64_t max_len, int64_t bs,
                   float scale, float *out, float *scratch, const uint8_t *pool8, int64_t W, int64_t soff,
                   int64_t roff, int64_t group, float *kb, int64_t fp4, int64_t toff) {
    if (pool8 && fp4 && C % 16) return -1;   /* fp4 rows hold whole groups of 16 (the launcher checks first) */
    for (int64_t b = 0; b < B; b++) {      /* nothing outside the pool or the scratch is ever read */
        if (lens[b] < 1 || lens[b] > max_len || (lens[b] - 1) / bs >= max_blocks) return -1;
        for (int64_t i = 0; i <= (lens[b] - 1) / bs; i++)
            if (table[b * max_blocks + i] < 0 || table[b * max_blocks + i] >= num_blocks) return -1;
    }
    if (!pool8 && pdt == WD_BF16 && bf16_dot() && amx_on()
        && mla_decode_amx(q, B, Nh, D, C, pool, table, max_blocks, lens, max_len, bs, scale, out))
        return 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b];
        float *inv = scratch + Nh * L;
        const float *qb = q + b * Nh * D;
        float *ob = out + b * Nh * C, *sc = scratch;
        /* rows j0 .. j0 + n - 1 (never past their block): in place, or dequantised into kb (in L1) */
#define ROW0(j0) (table[b * max_blocks + (j0) / bs] * bs + (j0) % bs)
#define ROWS(j0, n) (!pool8 ? (const float *)pool + ROW0(j0) * D                                              \
                     : fp4 ? fp4_rows(pool8, W, soff, toff, roff, pdt, C, D, ROW0(j0), n, kb)                    \
                     : fp8_rows(pool8, W, soff, roff, pdt, group, C, D, ROW0(j0), n, kb))
#define CHUNK(j0) (L - (j0) < step - (j0) % step ? L - (j0) : step - (j0) % step)
        int64_t step = pool8 && bs > FP8_ROWS ? FP8_ROWS : bs, bf = !pool8 && pdt == WD_BF16;
        const uint16_t *p16 = pool;
        for (int64_t j0 = 0; j0 < L; j0 += CHUNK(j0)) {
            if (bf) linear_bf16(qb, D, p16 + ROW0(j0) * D, D, sc + j0, L, Nh, CHUNK(j0), D);
            else linear(qb, D, ROWS(j0, CHUNK(j0)), D, sc + j0, L, Nh, CHUNK(j0), D);
        }
        for (int64_t n = 0; n < Nh; n++) inv[n] = softmax_row(sc + n * L, L, scale);   /* the 1 / sum comes last */
        memset(ob, 0, Nh * C * sizeof(float));
        for (int64_t j0 = 0, nj; j0 < L; j0 += nj) {
            nj = CHUNK(j0);
            if (bf) pv_rows(NULL, p16 + ROW0(j0) * D, D, nj, sc + j0, L, ob, C, Nh);
            else pv_rows(ROWS(j0, nj), NULL, D, nj, sc + j0, L, ob, C, Nh);
        }
#undef ROWS
#undef ROW0
#undef CHUNK
        for (int64_t n = 0; n < Nh; n++)
            for (int64_t c = 0; c < C; c++) ob[n * C + c] *= inv[n];
    }
    return 0;
}

int64_t wd_mla_decode(const wd_mla_decode_args *a) {
    return mla_decode(a->q, a->B, a->Nh, a->D, a->C, a->pool, a->pdt, a->num_blocks, a->table, a->max_blocks, a->lens,
                      a->max_len, a->bs, a->scale, a->out, a->scratch, a->pool8, a->W, a->soff, a->roff, a->group,
                      a->kb, a->fp4, a->toff);
}
