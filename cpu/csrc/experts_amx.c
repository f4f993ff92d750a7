/* One routed expert's work on AMX tiles (experts.c calls it for bfloat16 weights where the tiles are on, H and I
   multiples of 32): out[row] += wt * w2 @ silu(gate) * up, gate / up = w13 @ x[row], for the expert's np rows,
   with nothing between the two GEMMs but the tiles' own operands:
   - x's rows are gathered (by id) and rounded into pair-interleaved B tiles once;
   - the gate-up GEMM runs gate rows n .. n + 15 and up rows I + n .. I + n + 15 of w13 as two A tiles against the
     same B tiles, so one tile's epilogue holds both halves of a [16 features][16 rows] block: the SwiGLU (clamped
     where limit > 0) is applied there and the result rounded straight into the down GEMM's B tiles (two features
     a pair, as the tiles want them);
   - the down GEMM's sums are transposed on the way out and added, times each row's routing weight, into out.
   The separate path (gemm_amx.c's GEMM per matrix, with the float32 h, a and y between them) wrote and read
   ~6 MB per expert at 384 rows (H 1024, I 256); this one none (measured in docs/kernels.md).
   Weights are read as stored (w13 [2I, H], w2 [H, I] row major, the A tiles' strides their row strides); while
   the first rows of x pass over a block of weight rows, the next block's lines are asked into L2 (gemm_amx.c says
   why). */
#include "wideep.h"

#if WD_AMX
#include "amx.h"

static inline AMXF __m512 silu_mul(__m512 g, __m512 u, float limit) {
    if (limit > 0) {
        g = _mm512_min_ps(g, _mm512_set1_ps(limit));
        u = _mm512_max_ps(_mm512_min_ps(u, _mm512_set1_ps(limit)), _mm512_set1_ps(-limit));
    }
    v16 e = vexp((v16)_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), (__m512)e)), u);
}

/* gate tile cg and up tile cu ([16 features n0 ..][16 rows]) -> their SwiGLU as 8 pair rows of a B tile of the down
   GEMM: t[p] = (a[2p][m], a[2p + 1][m]) for m = 0 .. 15, bfloat16 */
static inline AMXF void swiglu_pairs(const float *cg, const float *cu, float limit, __m512i idx, uint16_t *t) {
    for (int p = 0; p < 8; p++) {
        __m512 a0 = silu_mul(_mm512_load_ps(cg + 32 * p), _mm512_load_ps(cu + 32 * p), limit);
        __m512 a1 = silu_mul(_mm512_load_ps(cg + 32 * p + 16), _mm512_load_ps(cu + 32 * p + 16), limit);
        _mm512_store_si512(t + 32 * p, _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(a1, a0)));
    }
}

/* sums tile TILE ([16 outputs h0 ..][16 rows m0 ..]) transposed, times each row's weight, added into out */
#define SCATTER(TILE, H0, M0)                                                                      \
    {                                                                                              \
        __m512i r_[16];                                                                            \
        TILE_TR(TILE, c, r_);                                                                      \
        for (int64_t m_ = 0; m_ < 16 && (M0) + m_ < np; m_++) {                                    \
            float *o_ = out + rows[(M0) + m_] * H + (H0);                                          \
            _mm512_storeu_ps(o_, _mm512_fmadd_ps(_mm512_set1_ps(wts[(M0) + m_]), (__m512)r_[m_], _mm512_loadu_ps(o_))); \
        }                                                                                          \
    }

AMXF int expert_amx(const void *x, int64_t xdt, const int64_t *rows, const float *wts, int64_t np, int64_t H, int64_t I,
                    const uint16_t *w13, const uint16_t *w2, const uint16_t *next13, float limit, float *out) {
    int64_t MT = (np + 15) / 16, KB1 = H / 32, KB2 = I / 32;
    uint16_t *xb = amx_scratch(2, MT * 16 * (H + I));
    if (!xb) return 0;
    uint16_t *ab = xb + MT * 16 * H;
    float c[256] __attribute__((aligned(64))), cu[256] __attribute__((aligned(64)));
    /* (a0, b0, a1, b1, ...) from a in the low 16 bfloat16, b in the high */
    __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                   20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t mt = 0; mt < MT; mt++)   /* x's rows, gathered and rounded into B tiles */
        for (int64_t kb = 0; kb < KB1; kb++) {
            __m512i r[16];
            for (int m = 0; m < 16; m++) {
                int64_t i = mt * 16 + m;
                if (i >= np) r[m] = _mm512_setzero_si512();
                else if (xdt == WD_BF16) r[m] = _mm512_loadu_si512((const uint16_t *)x + rows[i] * H + kb * 32);
                else r[m] = bf32((const float *)x + rows[i] * H + kb * 32);
            }
            tr16(r);
            for (int p = 0; p < 16; p++) _mm512_store_si512(xb + (mt * KB1 + kb) * 512 + p * 32, r[p]);
        }
    tiles_on();
    for (int64_t n = 0; n < I; n += 16) {   /* gate rows n.., up rows I + n.. */
        const uint16_t *wg = w13 + n * H, *wu = w13 + (I + n) * H;
        int pf = n + 16 < I;   /* the last block asks the down GEMM's first 32 rows instead */
        for (int64_t mt = 0; mt < MT; mt += 2) {
            int two = mt + 1 < MT;
            const uint16_t *b0 = xb + mt * KB1 * 512, *b1 = b0 + KB1 * 512;
            TILES_ZERO4();   /* tiles 0 / 1: gate / up of rows mt, 2 / 3 of rows mt + 1 */
            for (int64_t kb = 0; kb < KB1; kb++) {
                if (pf && mt == 0)
                    for (int r = 16; r < 32; r++) {
                        _mm_prefetch((const char *)(wg + r * H + kb * 32), _MM_HINT_T1);
                        _mm_prefetch((const char *)(wu + r * H + kb * 32), _MM_HINT_T1);
                    }
                else if (mt == 0 && kb < KB2)
                    for (int r = 0; r < 32; r++) _mm_prefetch((const char *)(w2 + r * I + kb * 32), _MM_HINT_T1);
                TILE_STEP(wg + kb * 32, wu + kb * 32, H * 2, b0 + kb * 512, b1 + kb * 512, 1, two);
            }
            /* ab's B tile (row tile, features n / 32), pair rows (n % 32) / 2 .. + 8 */
            TILE_STORE(0, c, 64);
            TILE_STORE(1, cu, 64);
            swiglu_pairs(c, cu, limit, idx, ab + (mt * KB2 + n / 32) * 512 + (n % 32) / 2 * 32);
            if (two) {
                TILE_STORE(2, c, 64);
                TILE_STORE(3, cu, 64);
                swiglu_pairs(c, cu, limit, idx, ab + ((mt + 1) * KB2 + n / 32) * 512 + (n % 32) / 2 * 32);
            }
        }
    }
    for (int64_t h = 0; h < H; h += 32) {   /* w2 rows h .. h + 31 */
        const uint16_t *w0 = w2 + h * I, *w1 = w0 + 16 * I;
        int pf = h + 32 < H;
        for (int64_t mt = 0; mt < MT; mt += 2) {
            int two = mt + 1 < MT;
            const uint16_t *b0 = ab + mt * KB2 * 512, *b1 = b0 + KB2 * 512;
            TILES_ZERO4();   /* tiles 0 / 1: outputs h.. / h + 16.. of rows mt, 2 / 3 of rows mt + 1 */
            for (int64_t kb = 0; kb < KB2; kb++) {
                if (pf && mt == 0)
                    for (int r = 32; r < 64; r++) _mm_prefetch((const char *)(w0 + r * I + kb * 32), _MM_HINT_T1);
                else if (mt == 0 && next13)   /* the next expert's first gate and up rows (K I here, H there) */
                    for (int64_t r = 0; r < 16; r++)
                        for (int64_t l = kb * KB1 / KB2; l < (kb + 1) * KB1 / KB2; l++) {
                            _mm_prefetch((const char *)(next13 + r * H + l * 32), _MM_HINT_T1);
                            _mm_prefetch((const char *)(next13 + (I + r) * H + l * 32), _MM_HINT_T1);
                        }
                TILE_STEP(w0 + kb * 32, w1 + kb * 32, I * 2, b0 + kb * 512, b1 + kb * 512, 1, two);
            }
            SCATTER(0, h, mt * 16)
            SCATTER(1, h + 16, mt * 16)
            if (two) {
                SCATTER(2, h, mt * 16 + 16)
                SCATTER(3, h + 16, mt * 16 + 16)
            }
        }
    }
    _tile_release();
    amx_count(0);
    return 1;
}
#else
int expert_amx(const void *x, int64_t xdt, const int64_t *rows, const float *wts, int64_t np, int64_t H, int64_t I,
               const uint16_t *w13, const uint16_t *w2, const uint16_t *next13, float limit, float *out) {
    (void)x, (void)xdt, (void)rows, (void)wts, (void)np, (void)H, (void)I, (void)w13, (void)w2, (void)next13;
    (void)limit, (void)out;
    return 0;
}
#endif
