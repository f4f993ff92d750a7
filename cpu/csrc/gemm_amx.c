/* The GEMM for bfloat16 weights on AMX tiles (Intel AMX-BF16: Sapphire Rapids and later; docs/kernels.md).
   TDPBF16PS multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32 sums: 16 times the
   products of one AVX512-BF16 instruction. gemm.c calls linear_amx for bfloat16 weights when the dot products
   are on, AMX is on (amx_on(): the CPU has the tiles, the kernel let this process use them, no one turned
   them off: wd_amx) and x has at least AMX_MIN_ROWS rows. x is rounded to bfloat16 as gemm_bf16dp.c rounds it;
   sums stay float32.

   Two loop forms, both reading the weights as stored (no repacked copy kept anywhere):
   - skinny (M <= WIDE_MIN_ROWS, decode steps and most experts): the weights are the A tiles, read in place (16
     rows of w, 64 bytes of each: the tile load's stride is w's row stride), x the B tiles, packed once per
     call into the pair-interleaved ("VNNI") layout TDPBF16PS wants: [16 pairs of K][16 rows][2]. The sums
     come out as y^T blocks and are transposed in registers on the way out. Blocks of 32 rows of w x 32 rows
     of x (4 sums, 2 + 2 operands: the 8 tiles); while the first rows of x pass over a block, the next
     block's weight lines are asked into the cache, L2 (L1 for rows past PF_L1_MIN_K) (the tile loads are 16
     streams at once, past what the hardware prefetcher follows: without it the decode-sized calls streamed at
     ~8 GB/s, with it ~13, the plain read's speed on this Xeon).
   - wide (more rows: prefill): x the A tiles (rows rounded to bfloat16, row major), w the B tiles, packed per
     call into the VNNI layout a group of rows at a time (a 16 x 16 transpose of 32-bit pairs per 1 KiB);
     the sums land in y as they are.
   Rows of w past the last multiple of 16 go to the dot-product kernel; K past the last multiple of 32 is
   added by a masked dot product (tail_k), so no tile ever reads past a row or the matrix.

   Measured (one thread, this Xeon, bench/bf16_gemm.py): docs/kernels.md. */
#include <stdlib.h>

#include "wideep.h"

#if WD_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"

/* rows of w longer than this (bfloat16 elements: 8 KiB) are asked into L1 (T0), shorter ones into L2 (T1). Measured
   (one thread, this Xeon, weights streamed from memory, 4-64 rows of x): at K 7168 (DeepSeek-V3's hidden size: the
   head, the dense MLP) T1 streamed at ~9 GB/s and T0 at ~12 (129280 x 7168 at 16 rows 208 -> 153 ms, faster than
   oneDNN's 165), at K 1024-4096 the two are even within +-5 %. */
#define PF_L1_MIN_K 4096

/* more rows than this run the wide form (measured: at 384 rows the two are even; at 2048 the wide form
   1.2-1.6x faster) */
#define WIDE_MIN_ROWS 512
/* the wide form's rows of x per pass over a packed group of w (MC x K bfloat16: 512 KiB at K 1024, in L2) */
#define MC 256
/* the wide form's packed group of w (bytes): it stays in L2 while MC rows of x pass */
#ifndef WPACK_MAX
#define WPACK_MAX ((int64_t)512 << 10)
#endif

/* Where a call's activations come from: row m of x is row rows[m] (rows NULL: m) of a float32 or bfloat16 (xdt)
   matrix with rows ldx elements apart. */
typedef struct {
    const void *x;
    int64_t xdt, ldx;
    const int64_t *rows;
} xsrc;

/* 32 values of row m from feature k, as 32 bfloat16 (16 pairs) */
static inline AMXF __m512i x32(const xsrc *s, int64_t m, int64_t k) {
    int64_t r = (s->rows ? s->rows[m] : m) * s->ldx + k;
    return s->xdt == WD_BF16 ? _mm512_loadu_si512((const uint16_t *)s->x + r) : bf32((const float *)s->x + r);
}

/* x [M, K32] -> xb: per 16 rows (zero-padded) and 32 features, one 1 KiB B tile [16 pairs][16 rows][2] */
static AMXF void pack_x_vnni(const xsrc *s, int64_t M, int64_t K32, uint16_t *xb) {
    int64_t MT = (M + 15) / 16, KB = K32 / 32;
    for (int64_t mt = 0; mt < MT; mt++)
        for (int64_t kb = 0; kb < KB; kb++) {
            __m512i r[16];
            for (int m = 0; m < 16; m++)
                r[m] = mt * 16 + m < M ? x32(s, mt * 16 + m, kb * 32) : _mm512_setzero_si512();
            tr16(r);
            uint16_t *t = xb + (mt * KB + kb) * 512;
            for (int p = 0; p < 16; p++) _mm512_store_si512(t + p * 32, r[p]);
        }
}

/* tile c (sums [16 rows of w][16 rows of x]) transposed into y: rows 0 .. mrows-1 of x, 16 outputs each */
#define OUT_T(TILE, Y, MROWS)                                                                      \
    {                                                                                              \
        __m512i r_[16];                                                                            \
        TILE_TR(TILE, c, r_);                                                                      \
        for (int64_t m_ = 0; m_ < (MROWS); m_++) _mm512_storeu_si512((Y) + m_ * ldy, r_[m_]);      \
    }

/* The matrix a caller multiplies next (amx_next), whose first rows the skinny form asks into L2 while it runs its
   own last block: each matrix would otherwise start on a cold stream (the decode step's projections and per-head
   GEMMs, with the next sequence's cache rows in mla_amx.c and the next expert's in experts_amx.c: a decode step of
   the vs_vllm model 1-3 % faster at 16 and 64 sequences, A/B of the two libraries interleaved in one engine). Read
   and cleared by the next call on the tiles. */
typedef struct {
    const uint16_t *w;
    int64_t ldw, rows, kb;
} wnext;
static __thread wnext hint;

void amx_next(const void *w, int64_t ldw, int64_t rows, int64_t K) {
    hint = (wnext){w, ldw, rows < 32 ? rows : 32, K / 32};
}

/* y [M, N16] = x [M, K32] @ w [N16, K32]^T, the weights as A tiles (file comment); next: the rows to ask into L2
   during the last block (next.w NULL: none) */
static AMXF void skinny(const uint16_t *xb, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
                        int64_t N16, int64_t K32, wnext next) {
    int64_t MT = (M + 15) / 16, KB = K32 / 32, sw = ldw * 2;
    float c[256] __attribute__((aligned(64)));
    for (int64_t n = 0; n < N16; n += 32) {
        int two_n = n + 16 < N16;
        const uint16_t *w0 = w + n * ldw, *w1 = w0 + 16 * ldw;
        /* while the first rows of x pass over these 32 rows of w: the next 32 asked into L2, or the next matrix's */
        wnext pf = n + 32 < N16 ? (wnext){w0 + 32 * ldw, ldw, N16 - n - 32 < 32 ? N16 - n - 32 : 32, KB} : next;
        for (int64_t mt = 0; mt < MT; mt += 2) {
            int two_m = mt + 1 < MT;
            int64_t prows = mt == 0 && pf.w ? pf.rows : 0;
            const uint16_t *b0 = xb + mt * KB * 512, *b1 = b0 + KB * 512;
            TILES_ZERO4();
            for (int64_t kb = 0; kb < KB; kb++) {
                if (kb < pf.kb) {
                    if (pf.ldw > PF_L1_MIN_K)
                        for (int64_t r = 0; r < prows; r++)
                            _mm_prefetch((const char *)(pf.w + r * pf.ldw + kb * 32), _MM_HINT_T0);
                    else
                        for (int64_t r = 0; r < prows; r++)
                            _mm_prefetch((const char *)(pf.w + r * pf.ldw + kb * 32), _MM_HINT_T1);
                }
                TILE_STEP(w0 + kb * 32, w1 + kb * 32, sw, b0 + kb * 512, b1 + kb * 512, two_n, two_m);
            }
            int64_t m0 = mt * 16, r0 = M - m0 < 16 ? M - m0 : 16, r1 = M - m0 - 16 < 16 ? M - m0 - 16 : 16;
            float *y0 = y + m0 * ldy + n;
            OUT_T(0, y0, r0)
            if (two_n) OUT_T(1, y0 + 16, r0)
            if (two_m) {
                OUT_T(2, y0 + 16 * ldy, r1)
                if (two_n) OUT_T(3, y0 + 16 * ldy + 16, r1)
            }
        }
    }
}

/* the sums of tile TILE (16 rows of x x 16 outputs) into y, its first R rows (a partial block through c) */
#define OUT(TILE, Y, R)                                                                            \
    if ((R) == 16) TILE_STORE(TILE, Y, ldy * 4);                                                 \
    else if ((R) > 0) {                                                                            \
        TILE_STORE(TILE, c, 64);                                                                 \
        for (int64_t i_ = 0; i_ < (R); i_++) memcpy((Y) + i_ * ldy, c + 16 * i_, 64);             \
    }

/* y [M, N16] = x [M, K32] @ w [N16, K32]^T, x as A tiles, w packed into B tiles a group of G rows at a time (file
   comment). The rows of x as bfloat16: x itself where it is bfloat16 and not gathered (its last M % 32 rows through a
   zero-padded copy in xa, so no tile reads past it), else rounded and gathered once into xa (rows lda apart). The
   loops keep a packed group of w (G x K32, ~512 KiB) and MC rows of x in L2 while the 2 x 2 tiles run over them
   (measured, one thread: 2048 x 2048 x 1024 at ~620 GFLOP/s with x streamed from L3 for every 32 rows of w, ~1.2
   TFLOP/s with both in L2). */
static AMXF void wide(const xsrc *s, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M, int64_t N16,
                      int64_t K32, int64_t G, uint16_t *wp, uint16_t *xa) {
    /* x's rows a cache line more than K32 apart: at a multiple of 4 KiB the 16 rows of a tile load share two
       L1 sets (measured: 2048-element rows ran ~10 % slower unpadded) */
    int64_t KB = K32 / 32, lp = K32 + 32, M32 = M & ~(int64_t)31, Mp = (M + 31) & ~(int64_t)31;
    int direct = s->xdt == WD_BF16 && !s->rows;
    const uint16_t *a = direct ? (const uint16_t *)s->x : xa;
    int64_t lda = direct ? s->ldx : lp;
    for (int64_t m = direct ? M32 : 0; m < Mp; m++)   /* the rows copied: the tail (direct), or all */
        for (int64_t kb = 0; kb < KB; kb++)
            _mm512_store_si512(xa + (m - (direct ? M32 : 0)) * lp + kb * 32,
                               m < M ? x32(s, m, kb * 32) : _mm512_setzero_si512());
    float c[256] __attribute__((aligned(64)));
    for (int64_t g = 0; g < N16; g += G) {
        int64_t gn = N16 - g < G ? N16 - g : G, GT = gn / 16;
        for (int64_t nt = 0; nt < GT; nt++)
            for (int64_t kb = 0; kb < KB; kb++) {
                __m512i r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(w + (g + nt * 16 + i) * ldw + kb * 32);
                tr16(r);
                uint16_t *t = wp + (nt * KB + kb) * 512;
                for (int p = 0; p < 16; p++) _mm512_store_si512(t + p * 32, r[p]);
            }
        for (int64_t m0 = 0; m0 < Mp; m0 += MC)
            for (int64_t nt = 0; nt < GT; nt += 2) {
                int two_n = nt + 1 < GT;
                const uint16_t *b0 = wp + nt * KB * 512, *b1 = b0 + KB * 512;
                for (int64_t m = m0; m < Mp && m < m0 + MC; m += 32) {
                    int tail = direct && m >= M32;
                    const uint16_t *a0 = tail ? xa : a + m * lda;
                    int64_t sa = (tail ? lp : lda) * 2;
                    const uint16_t *a1 = a0 + 16 * (sa / 2);
                    TILES_ZERO4();   /* (tiles 0 / 1: rows m.. / m + 16.. against w's first 16 rows, 2 / 3 its next) */
                    for (int64_t kb = 0; kb < KB; kb++)
                        TILE_STEP(a0 + kb * 32, a1 + kb * 32, sa, b0 + kb * 512, b1 + kb * 512, 1, two_n);
                    int64_t r0 = M - m < 16 ? M - m : 16, r1 = M - m - 16 < 16 ? M - m - 16 : 16;
                    float *y0 = y + m * ldy + g + nt * 16;
                    OUT(0, y0, r0)
                    OUT(1, y0 + 16 * ldy, r1)
                    if (two_n) {
                        OUT(2, y0 + 16, r0)
                        OUT(3, y0 + 16 * ldy + 16, r1)
                    }
                }
            }
    }
}

/* y [M, N16] += x [M, K32..K) . w [N16, K32..K) (fewer than 32 features), x rounded to bfloat16 as the
   tiles round it */
static AMXF void tail_k(const xsrc *s, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M, int64_t N16,
                        int64_t K32, int64_t K) {
    int64_t n = K - K32;
    __mmask16 lo = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1), hi = n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
    __mmask32 mw = (__mmask32)((1ull << n) - 1);
    for (int64_t m = 0; m < M; m++) {
        int64_t r = (s->rows ? s->rows[m] : m) * s->ldx + K32;
        __m512i xv;
        if (s->xdt == WD_BF16) {
            xv = _mm512_maskz_loadu_epi16(mw, (const uint16_t *)s->x + r);
        } else {
            const float *xr = (const float *)s->x + r;
            xv = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xr + 16), _mm512_maskz_loadu_ps(lo, xr));
        }
        for (int64_t j = 0; j < N16; j++) {
            __m512i wv = _mm512_maskz_loadu_epi16(mw, w + j * ldw + K32);
            y[m * ldy + j] += _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv, (__m512bh)wv));
        }
    }
}

/* the rows of x as float32 [M, K] contiguous (the dot-product kernel's input, for the rows of w past the tiles):
   x itself where it is float32 and not gathered, else a copy in `tmp` (NULL: no memory) */
static const float *x_f32(const xsrc *s, int64_t M, int64_t K, int64_t *ldx, float **tmp) {
    *tmp = NULL;
    if (s->xdt != WD_BF16 && !s->rows) {
        *ldx = s->ldx;
        return s->x;
    }
    float *t = malloc((size_t)(M * K) * sizeof(float));
    if (!t) return NULL;
    int64_t esz = s->xdt == WD_BF16 ? 2 : 4;
    for (int64_t m = 0; m < M; m++)
        row_f32((const char *)s->x + (s->rows ? s->rows[m] : m) * s->ldx * esz, s->xdt, K, t + m * K);
    *ldx = K;
    return *tmp = t;
}

AMXF int linear_amx_rows(const void *x, int64_t xdt, int64_t ldx, const int64_t *rows, const uint16_t *w, int64_t ldw,
                         float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int64_t N16 = N & ~(int64_t)15, K32 = K & ~(int64_t)31, G = 0;
    if (!N16 || !K32) return 0;
    xsrc s = {x, xdt, ldx, rows};
    wnext next = hint;   /* this call's: cleared, so that no later call reads it */
    hint.w = NULL;
    float *tmp = NULL;
    int64_t ldf = 0;
    const float *xf = NULL;
    if (N16 < N && !(xf = x_f32(&s, M, K, &ldf, &tmp))) return 0;   /* before anything is written */
    uint16_t *buf;
    if (M > WIDE_MIN_ROWS) {
        G = WPACK_MAX / (K32 * 2) & ~(int64_t)31;
        G = G < 32 ? 32 : G > N16 ? N16 : G;
        int64_t xrows = xdt == WD_BF16 && !rows ? 32 : (M + 31) & ~(int64_t)31;
        buf = amx_scratch(0, G * K32 + xrows * (K32 + 32));
    } else {
        buf = amx_scratch(0, (M + 15) / 16 * 16 * K32);
    }
    if (!buf) {
        free(tmp);
        return 0;
    }
    if (!G) pack_x_vnni(&s, M, K32, buf);
    tiles_on();
    if (G) wide(&s, w, ldw, y, ldy, M, N16, K32, G, buf, buf + G * K32);
    else skinny(buf, w, ldw, y, ldy, M, N16, K32, next);
    _tile_release();   /* the tiles back in their initial state: oneDNN configures its own at its next call */
    if (K32 < K) tail_k(&s, w, ldw, y, ldy, M, N16, K32, K);
    if (N16 < N) linear_bf16dp(xf, ldf, w + N16 * ldw, ldw, y + N16, ldy, M, N - N16, K);
    free(tmp);
    amx_count(0);
    return 1;
}

int linear_amx(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
               int64_t N, int64_t K) {
    return linear_amx_rows(x, WD_F32, ldx, NULL, w, ldw, y, ldy, M, N, K);
}

int amx_supported(void) {
    static int ok = -1;
    if (ok < 0) {
        unsigned a, b, c, d;
        ok = bf16dp_supported() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1);
        /* Linux hands a process the tiles' 8 KiB of state only once asked (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
        if (ok) ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return ok;
}
#else
void amx_next(const void *w, int64_t ldw, int64_t rows, int64_t K) { (void)w, (void)ldw, (void)rows, (void)K; }
int linear_amx_rows(const void *x, int64_t xdt, int64_t ldx, const int64_t *rows, const uint16_t *w, int64_t ldw,
                    float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    (void)x, (void)xdt, (void)ldx, (void)rows, (void)w, (void)ldw, (void)y, (void)ldy, (void)M, (void)N, (void)K;
    return 0;
}
int linear_amx(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
               int64_t N, int64_t K) {
    return linear_amx_rows(x, WD_F32, ldx, NULL, w, ldw, y, ldy, M, N, K);
}
int amx_supported(void) { return 0; }
#endif

static int amx_state = -1;   /* -1: not decided yet (the first call decides: on where the CPU and the kernel allow) */
static int64_t calls[3];

void amx_count(int which) { __atomic_fetch_add(&calls[which], 1, __ATOMIC_RELAXED); }
void amx_count_parts(int parts) { __atomic_fetch_add(&calls[2], parts, __ATOMIC_RELAXED); }

int amx_on(void) {
    if (amx_state < 0) amx_state = amx_supported();
    return amx_state;
}

int64_t wd_amx(wd_amx_args *a) {
    a->supported = amx_supported();
    if (a->want == 0) amx_state = 0;
    else if (a->want == 1) amx_state = a->supported;
    a->gemm_calls = __atomic_load_n(&calls[0], __ATOMIC_RELAXED);
    a->mla_calls = __atomic_load_n(&calls[1], __ATOMIC_RELAXED);
    a->fp8_parts = __atomic_load_n(&calls[2], __ATOMIC_RELAXED);
    return amx_on();
}
