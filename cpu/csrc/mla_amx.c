/* The absorbed MLA decode over a bfloat16 latent cache on AMX tiles (mla_decode.c calls it where the dot
   products and the tiles are on: amx_on()). Per sequence, as mla_decode's own loops do it, in three products:
   - scores [L, Nh] = latent rows [L, D] . q^T: the cache rows are the A tiles, read in place (16 rows of a
     block at a time; a partial group of rows, or a block size that is not a multiple of 16, goes through a
     zero-padded copy, so no tile reads past a block), q the B tiles (rounded to bfloat16, pair-interleaved
     once per sequence; heads padded to 16);
   - softmax over each head's scores in float32 (mla_decode's: max, exp, the 1 / sum applied at the end);
   - out [Nh, C] = p [Nh, L] . latent[:, :C]: p rounded to bfloat16 as the A tiles, the latent's c part
     packed into pair-interleaved B tiles (two rows' 16 values at a time, one permute), once per sequence.
   The float32 loops it replaces read each row with FMAs, ~60 GFLOP/s on this Xeon: 4.6-4.7 ms for a layer of 64
   sequences of 192 tokens with 8 heads against 2.3-2.4 ms here (interleaved in one process; the 14 MB of cache rows
   alone take ~1 ms at the core's ~14 GB/s). p is rounded to bfloat16 here where mla_decode's loops keep it float32
   (the same rounding the scores' q gets). */
#include "wideep.h"

#if WD_AMX
#include "amx.h"

AMXF int mla_decode_amx(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const uint16_t *pool,
                   const int64_t *table, int64_t max_blocks, const int32_t *lens, int64_t max_len, int64_t bs,
                   float scale, float *out) {
    if (D % 32 || C % 32) return 0;
    int64_t HT = (Nh + 15) / 16, KD = D / 32, CT = C / 16, Lm = (max_len + 31) & ~(int64_t)31;
    int64_t nq = HT * KD * 512, nsc = HT * 16 * Lm * 2, npa = HT * 16 * Lm, nvp = CT * (Lm / 32) * 512;
    int64_t nrow = 16 * D, ninv = HT * 32;
    uint16_t *buf = amx_scratch(1, nq + nsc + npa + nvp + nrow + ninv);
    if (!buf) return 0;
    uint16_t *qp = buf, *pa = qp + nq + nsc, *vp = pa + npa, *rowbuf = vp + nvp;
    float *sc = (float *)(qp + nq), *inv = (float *)(rowbuf + nrow);
    float c[256] __attribute__((aligned(64)));
    /* interleaves two rows' 16 values: (a0, b0, a1, b1, ...) from a in the low half, b in the high */
    __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                     20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    memset(pa, 0, npa * sizeof(uint16_t));   /* the padded heads' rows stay zero */
    tiles_on();
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b], Lp = (L + 31) & ~(int64_t)31, JB = Lp / 32;
        const float *qb = q + b * Nh * D;
        float *ob = out + b * Nh * C;
        const int64_t *tb = table + b * max_blocks;
#define ROW(j) (pool + (tb[(j) / bs] * bs + (j) % bs) * D)
        for (int64_t ht = 0; ht < HT; ht++)
            for (int64_t kb = 0; kb < KD; kb++) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = ht * 16 + i < Nh ? bf32(qb + (ht * 16 + i) * D + kb * 32) : _mm512_setzero_si512();
                tr16(r);
                for (int p = 0; p < 16; p++) _mm512_store_si512(qp + (ht * KD + kb) * 512 + p * 32, r[p]);
            }
        for (int64_t j0 = 0; j0 < L; j0 += 16) {
            int64_t n = L - j0 < 16 ? L - j0 : 16;
            const uint16_t *a = ROW(j0);
            if (n < 16 || bs % 16) {
                for (int64_t i = 0; i < 16; i++)
                    if (i < n) memcpy(rowbuf + i * D, ROW(j0 + i), D * sizeof(uint16_t));
                    else memset(rowbuf + i * D, 0, D * sizeof(uint16_t));
                a = rowbuf;
            }
            /* the next 16 rows asked into L2 while these are multiplied: the tile loads' 16 strided streams are
               more than the hardware prefetcher follows */
            const char *nx = j0 + 16 < L ? (const char *)ROW(j0 + 16) : NULL;
            int64_t nlines = nx ? (L - j0 - 16 < 16 ? L - j0 - 16 : 16) * D * 2 / 64 : 0;
            if (bs % 16) nlines = nlines < D * 2 / 64 ? nlines : D * 2 / 64;   /* only the next row is contiguous */
            for (int64_t ht = 0; ht < HT; ht++) {
                _tile_zero(0);
                for (int64_t kb = 0; kb < KD; kb++) {
                    if (ht == 0)
                        for (int64_t l = kb * nlines / KD; l < (kb + 1) * nlines / KD; l++)
                            _mm_prefetch(nx + 64 * l, _MM_HINT_T1);
                    TILE_STEP(a + kb * 32, a, D * 2, qp + (ht * KD + kb) * 512, qp, 0, 0);
                }
                __m512i r[16];
                TILE_TR(0, c, r);   /* r[h]: head h's scores of rows j0 .. j0 + 15 */
                for (int64_t h = 0; h < 16 && ht * 16 + h < Nh; h++)
                    _mm512_storeu_si512(sc + (ht * 16 + h) * Lm + j0, r[h]);
            }
        }
        for (int64_t h = 0; h < Nh; h++) {   /* p = exp((s - max) * scale), rounded to bfloat16; 1 / sum kept */
            float *s = sc + h * Lm, mx = -INFINITY;
            for (int64_t j = 0; j < L; j++) mx = s[j] > mx ? s[j] : mx;
            __m512 acc = _mm512_setzero_ps();
            uint16_t *ph = pa + h * Lm;
            for (int64_t j = 0; j < Lp; j += 16) {
                __mmask16 m = L - j >= 16 ? (__mmask16)0xffff : L - j <= 0 ? 0 : (__mmask16)((1u << (L - j)) - 1);
                v16 e = vexp((ld(s + j) - bc(mx)) * bc(scale));
                __m512 ev = _mm512_maskz_mov_ps(m, (__m512)e);
                acc = _mm512_add_ps(acc, ev);
                _mm256_storeu_si256((__m256i *)(ph + j), (__m256i)_mm512_cvtneps_pbh(ev));
            }
            inv[h] = 1.0f / _mm512_reduce_add_ps(acc);
        }
        /* the next sequence's first 16 rows asked into L2 while these are packed (its scores start cold else) */
        const char *nb = NULL;
        int64_t nlines = 0;
        if (b + 1 < B) {
            nb = (const char *)(pool + table[(b + 1) * max_blocks] * bs * D);
            int64_t n = lens[b + 1] < 16 ? lens[b + 1] : 16;   /* (within its first block) */
            nlines = (n < bs ? n : bs) * D * 2 / 64;
        }
        for (int64_t jb = 0; jb < JB; jb++) {
            const uint16_t *rows[32];
            for (int i = 0; i < 32; i++) rows[i] = jb * 32 + i < L ? ROW(jb * 32 + i) : NULL;
            for (int64_t l = jb * nlines / JB; l < (jb + 1) * nlines / JB; l++) _mm_prefetch(nb + 64 * l, _MM_HINT_T1);
            for (int64_t ct = 0; ct < CT; ct++) {
                uint16_t *t = vp + (ct * JB + jb) * 512;
                for (int r = 0; r < 16; r++) {
                    __m256i lo = rows[2 * r] ? _mm256_loadu_si256((const __m256i *)(rows[2 * r] + ct * 16))
                                             : _mm256_setzero_si256();
                    __m256i hi = rows[2 * r + 1] ? _mm256_loadu_si256((const __m256i *)(rows[2 * r + 1] + ct * 16))
                                                 : _mm256_setzero_si256();
                    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                    _mm512_store_si512(t + r * 32, _mm512_permutexvar_epi16(pairs, v));
                }
            }
        }
#undef ROW
        for (int64_t ht = 0; ht < HT; ht++) {
            int64_t nh = Nh - ht * 16 < 16 ? Nh - ht * 16 : 16;
            const uint16_t *ap = pa + ht * 16 * Lm;
            float *oh = ob + ht * 16 * C;
            for (int64_t ct = 0; ct < CT; ct += 2) {
                _tile_zero(0);
                _tile_zero(2);
                for (int64_t jb = 0; jb < JB; jb++)   /* tiles 0 / 2: outputs ct.. / ct + 16.. */
                    TILE_STEP(ap + jb * 32, ap, Lm * 2, vp + (ct * JB + jb) * 512, vp + ((ct + 1) * JB + jb) * 512, 0, 1);
                if (nh == 16) {
                    TILE_STORE(0, oh + ct * 16, C * 4);
                    TILE_STORE(2, oh + ct * 16 + 16, C * 4);
                } else {
                    TILE_STORE(0, c, 64);
                    for (int64_t h = 0; h < nh; h++) memcpy(oh + h * C + ct * 16, c + 16 * h, 64);
                    TILE_STORE(2, c, 64);
                    for (int64_t h = 0; h < nh; h++) memcpy(oh + h * C + ct * 16 + 16, c + 16 * h, 64);
                }
            }
        }
        for (int64_t h = 0; h < Nh; h++)
            for (int64_t i = 0; i < C; i += 16) st(ob + h * C + i, ld(ob + h * C + i) * bc(inv[h]));
    }
    _tile_release();
    amx_count(1);
    return 1;
}
#else
int mla_decode_amx(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const uint16_t *pool,
                   const int64_t *table, int64_t max_blocks, const int32_t *lens, int64_t max_len, int64_t bs,
                   float scale, float *out) {
    (void)q, (void)B, (void)Nh, (void)D, (void)C, (void)pool, (void)table, (void)max_blocks, (void)lens;
    (void)max_len, (void)bs, (void)scale, (void)out;
    return 0;
}
#endif
