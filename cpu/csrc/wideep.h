/* The CPU backend's C kernels (docs/kernels.md): the vector helpers every file shares, the struct each
   exported kernel takes (wd_<name>_args), the layer structs the fused calls read, and every prototype.
   cpu/build.py compiles all of the .c files of cpu/csrc into one library at first use; each Python launcher
   (cpu/gemm.py, layers.py, fused.py) passes one struct by address, whose ctypes twin is checked against
   wd_layouts() (layouts.c) when the library is loaded.

   Legend: M rows of activations, N output features, K input features, T tokens, H hidden, B decode
   sequences, Nh heads, C kv_lora_rank, R rope dim, D = C + R latent width, S cache rows, E experts,
   El local experts, k top-k, I moe_intermediate_size, Is a SwiGLU's intermediate size. Float32, row
   major, rows ld* elements apart where a stride is given. Weights (and the latent cache) may instead be
   bfloat16 where a struct has a dtype field (wdt, pdt: WD_F32 or WD_BF16), and the routed experts and
   wd_linear_fp8 FP8 blocks (WD_FP8: e4m3 bytes + a float32 scale per br x bk block, gemm_fp8.c):
   activations, norms, router scores and softmax stay float32 whatever the weights are. */
#ifndef WIDEEP_H
#define WIDEEP_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* ---- vector helpers (GCC/Clang vector extensions: 16 floats, whatever the ISA) ---- */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));
/* unaligned 16-float load / store. With AVX-512 the intrinsics: GCC 12 -march=native compiles the memcpy form
   into two 32-byte stores and a 64-byte reload (a failed store-to-load forward on every vector: a
   cache-resident float32 GEMM ran ~10x slower). */
#ifdef __AVX512F__
static inline v16 ld(const float *p) { return (v16)_mm512_loadu_ps(p); }
static inline void st(float *p, v16 v) { _mm512_storeu_ps(p, (__m512)v); }
#else
static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, 64); }
#endif
static inline v16 bc(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
/* keeps v in a register: without it GCC reloads a vector for every FMA that uses it. Only where a 16-float
   vector fits one register (AVX-512): elsewhere no register can hold it, and the constraint would not compile. */
#ifdef __AVX512F__
#define KEEP(v) __asm__("" : "+v"(v))
#else
#define KEEP(v) ((void)0)
#endif
#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

/* exp on 16 lanes: 2^n * e^f with n = round(x / ln 2), |f| <= ln 2 / 2, e^f by its Taylor series to
   f^6 (relative error ~1e-7); x clamped to [-87.3, 88] so that 2^n stays a normal float. */
static inline v16 vexp(v16 x) {
    i16 hi = x > bc(88.0f), lo = x < bc(-87.33f);
    x = (v16)(((i16)x & ~hi) | ((i16)bc(88.0f) & hi));
    x = (v16)(((i16)x & ~lo) | ((i16)bc(-87.33f) & lo));
    v16 n = (x * bc(1.44269504f) + bc(12582912.0f)) - bc(12582912.0f);   /* round to nearest */
    v16 f = x - n * bc(0.693145752f) - n * bc(1.42860677e-6f);
    v16 p = bc(1.0f / 720);
    p = p * f + bc(1.0f / 120); p = p * f + bc(1.0f / 24); p = p * f + bc(1.0f / 6);
    p = p * f + bc(0.5f); p = p * f + bc(1.0f); p = p * f + bc(1.0f);
    i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * (v16)e;
}

/* the sums of a, b, c, d (16 lanes each) in lanes 0, 4, 8, 12 of the result */
static inline v16 reduce4(v16 a, v16 b, v16 c, v16 d) {
    v16 ab = SHUF(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
           + SHUF(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 cd = SHUF(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
           + SHUF(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    v16 q = SHUF(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
          + SHUF(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    q += SHUF(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return q + SHUF(q, q, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

/* the first n (< 16) floats at p, zero-padded to 16 lanes (never reading past p + n) */
static inline v16 ld_part(const float *p, int64_t n) {
#ifdef __AVX512F__
    return (v16)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
#else
    v16 v = bc(0);
    for (int64_t i = 0; i < n; i++) v[i] = p[i];
    return v;
#endif
}

/* ---- bfloat16: the top 16 bits of a float32 ---- */

enum { WD_F32 = 0, WD_BF16 = 1, WD_FP8 = 2, WD_FP4 = 3 };
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
/* 16 bfloat16 at p widened to floats: zero-extend, shift into the high half (exact) */
static inline v16 ld_bf16(const uint16_t *p) {
#ifdef __AVX512F__   /* (as ld(): no round trip through the stack) */
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    u16x16 h;
    memcpy(&h, p, 32);
    i16 w = __builtin_convertvector(h, i16) << 16;
    v16 f;
    memcpy(&f, &w, 64);
    return f;
#endif
}
/* the first n (< 16) bfloat16 at p as floats, zero-padded (never reading past p + n) */
static inline v16 ld_bf16_part(const uint16_t *p, int64_t n) {
    uint16_t t[16] = {0};
    memcpy(t, p, n * sizeof(uint16_t));
    return ld_bf16(t);
}
/* float -> bfloat16, rounding to nearest even (torch's .to(torch.bfloat16)); a NaN stays a quiet NaN */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* n values at p (float32, or bfloat16: dt) as float32 into f (bfloat16 widened exactly) */
static inline void row_f32(const void *p, int64_t dt, int64_t n, float *f) {
    if (dt != WD_BF16) {
        memcpy(f, p, n * sizeof(float));
        return;
    }
    const uint16_t *b = p;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) st(f + i, ld_bf16(b + i));
    for (; i < n; i++) f[i] = from_bf16(b[i]);
}
/* element i of a weight vector of dtype wdt (WD_F32 / WD_BF16), for the vectors read once per row (norms) */
static inline float wget(const void *w, int64_t wdt, int64_t i) {
    return wdt == WD_BF16 ? from_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* ---- the kernels one file calls in another: positional, not exported from the library ---- */

#define WD_INTERNAL __attribute__((visibility("hidden")))

/* gemm.c: y [M, N] = x [M, K] @ w [N, K]^T; per batch b of B, x, w, y advance by sxb, swb, syb */
WD_INTERNAL void linear(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K);
/* An FP8 block-quantised matrix as the fused calls pass it: where a weight of dtype WD_FP8 is given to
   linear_w (or to swiglu, or as an MLA projection), the pointer is to one of these (cpu/fused.py Fp8Mat). */
typedef struct {
    const uint8_t *q;
    const float *s;
    int64_t lds, br, bk;
} wd_fp8_mat;

/* gemm.c, gemm_bf16dp.c: the same with bfloat16 w, and w of dtype wdt (WD_F32 / WD_BF16, or WD_FP8: w a
   const wd_fp8_mat *, ldw its rows' stride). linear_bf16 runs
   the AVX512-BF16 dot products (activations rounded to bfloat16) when bf16_dot() is on, else widens w to
   float32 and runs the float32 FMAs (activations exact). */
WD_INTERNAL void linear_bf16(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                             int64_t M, int64_t N, int64_t K);
WD_INTERNAL void linear_w(const float *x, int64_t ldx, const void *w, int64_t wdt, int64_t ldw, float *y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K);
WD_INTERNAL void bmm_nt(int64_t B, const float *x, int64_t sxb, int64_t ldx, const void *w, int64_t wdt, int64_t swb,
                        int64_t ldw, float *y, int64_t syb, int64_t ldy, int64_t M, int64_t N, int64_t K);
/* The streamed GEMM's rows of 1-3 tokens (gemm_tpl.h, gemm_avx2.c) read the weights at the memory's pace, one
   weight row after another, and the hardware prefetcher stops at every 4 KiB page (a float32 row of K 1024 is one
   page): every step of 32 weights asks for the lines WD_PF_AHEAD bytes further on, past the row's end into the
   next row's (a prefetch past the matrix's end does not fault), with locality hint WD_PF_HINT (2: into L2).
   Measured on the AMX Xeon, K 1024, N 2048, float32 weights streamed from memory, 40 interleaved calls each, GB/s
   at 1 / 2 / 3 rows: none 12.4 / 10.9 / 8.6; 512 B ahead 12.6 / 12.5 / 10.8; 1 KiB 13.3 / 12.8 / 11.8; 2 KiB
   14.1 / 13.9 / 13.1; 4 KiB 14.5 / 14.2 / 13.2; 8 KiB the same; 16 KiB 14.1 / 14.2 / 13.1; hint 3 (into L1) ~5 %
   slower, hint 0 (non-temporal) 0.55x; F.linear (MKL) 14.1 / 13.2 / 12.4. At K 7168, N 512: 12.9 GB/s at 1 row
   against 11.6 without and MKL's 15.0; 11.2 at 3 rows against 8.8 and MKL's 10.9. */
#ifndef WD_PF_AHEAD
#define WD_PF_AHEAD 4096
#endif
#ifndef WD_PF_HINT
#define WD_PF_HINT 2
#endif
/* gemm_avx2.c: linear for float32 (linear_f32_avx2) and bfloat16 weights widened (linear_bf16cvt_avx2) on 8-float
   AVX2 + FMA vectors, for builds with those and no AVX-512, where gemm_tpl.h's 16-float vectors spill (gemm.c
   calls them instead of its own then); elsewhere not built */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define WD_AVX2 1
#else
#define WD_AVX2 0
#endif
WD_INTERNAL void linear_f32_avx2(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                                 int64_t M, int64_t N, int64_t K);
WD_INTERNAL void linear_bf16cvt_avx2(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y,
                                     int64_t ldy, int64_t M, int64_t N, int64_t K);
/* gemm_bf16dp.c: whether this CPU has AVX512-BF16, whether its kernel is on, and the kernel (built for x86-64
   by compilers that know the instructions, whatever -march says; called only where the CPU has them) */
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 11 : __GNUC__ >= 10)
#define WD_BF16DP 1
#else
#define WD_BF16DP 0
#endif
WD_INTERNAL int bf16dp_supported(void);
WD_INTERNAL int bf16_dot(void);
WD_INTERNAL void linear_bf16dp(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                               int64_t M, int64_t N, int64_t K);
/* gemm_amx.c: the same GEMM on AMX tiles (bfloat16 weights; x rounded to bfloat16 as linear_bf16dp rounds it),
   built for x86-64 Linux by compilers that know the instructions; linear_amx returns 0 (nothing done) when
   the tiles are not there or its scratch could not be had. amx_on: the CPU has them, the kernel gave this
   process their state, and no one turned them off (wd_amx). */
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define WD_AMX 1
#else
#define WD_AMX 0
#endif
WD_INTERNAL int amx_supported(void);
WD_INTERNAL int amx_on(void);
WD_INTERNAL void amx_count(int which);   /* 0: a GEMM ran on the tiles, 1: a paged decode did (wd_amx reports) */
WD_INTERNAL void amx_count_parts(int parts);   /* an FP8 GEMM on the tiles split x into this many bfloat16 parts */
/* the bfloat16 matrix w [rows, K] (rows ldw apart) the caller multiplies after its next GEMM call: that call asks its
   first rows into L2 while it finishes (a hint: no effect off the tiles) */
WD_INTERNAL void amx_next(const void *w, int64_t ldw, int64_t rows, int64_t K);
WD_INTERNAL int linear_amx(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, float *y, int64_t ldy,
                           int64_t M, int64_t N, int64_t K);
/* experts_amx.c: one routed expert on the tiles, out[rows[i]] += wts[i] * w2 @ swiglu(w13 @ x[rows[i]]) for i < np,
   x [., H] float32 or bfloat16 (xdt), w13 [2I, H], w2 [H, I] bfloat16, H and I multiples of 32; limit > 0: the clamped
   SwiGLU; next13: the w13 of the expert run next (its first rows asked into L2 at the end), or NULL. 0 (nothing
   done) without scratch memory. */
WD_INTERNAL int expert_amx(const void *x, int64_t xdt, const int64_t *rows, const float *wts, int64_t np, int64_t H,
                           int64_t I, const uint16_t *w13, const uint16_t *w2, const uint16_t *next13, float limit,
                           float *out);
/* ... with row m of x being row rows[m] (rows NULL: m) of a float32 or bfloat16 (xdt) matrix, rows ldx apart:
   the routed experts' rows gathered and rounded as they are packed, no copy */
WD_INTERNAL int linear_amx_rows(const void *x, int64_t xdt, int64_t ldx, const int64_t *rows, const uint16_t *w,
                                int64_t ldw, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
/* gemm_fp8.c: y = x @ W^T for W [N, K] e4m3 bytes w (rows ldw apart) times the block scales s
   [ceil(N/br), ceil(K/bk)] (rows lds apart); bk a multiple of 16 */
WD_INTERNAL void linear_fp8(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                            int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
/* gemm_fp8_amx.c: the same on AMX tiles for FP8_AMX_MIN_ROWS..FP8_AMX_MAX_ROWS rows of x (the weights widened to
   bfloat16 once, x split into three bfloat16 parts: float32-grade sums); 0 (nothing done) where the shapes do not fit
   (K % 32, N % 16, br % 16, bk % 32), without the tiles or without scratch memory. linear_fp8 calls it where amx_on(). */
#ifndef FP8_AMX_MIN_ROWS
#define FP8_AMX_MIN_ROWS 4
#endif
#define FP8_AMX_MAX_ROWS 256
WD_INTERNAL int linear_fp8_amx(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s, int64_t lds,
                               int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
/* gemm_fp8_avx2.c: the same on 8-float AVX2 + FMA vectors where WD_AVX2 (gemm_fp8.c calls it then) */
WD_INTERNAL void linear_fp8_avx2(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const float *s,
                                 int64_t lds, int64_t br, int64_t bk, float *y, int64_t ldy, int64_t M, int64_t N,
                                 int64_t K);
/* gemm_fp4.c: y = x @ W^T for W [N, K] e2m1 pairs w (rows ldw bytes apart) times the e8m0 scales s [N, K/32]
   (rows lds apart); K a multiple of 32; xp: FP4_XP(M, K) floats of scratch */
#define FP4_XP(M, K) ((M) * (((K) + 127) / 128 * 128))
WD_INTERNAL void linear_fp4(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds,
                            float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, float *xp);
/* gemm_fp4_avx2.c: the same on 8-float AVX2 + FMA vectors where WD_AVX2 (gemm_fp4.c calls it then) */
WD_INTERNAL void linear_fp4_avx2(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, const uint8_t *s,
                                 int64_t lds, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, float *xp);
/* experts.c: x [T, H] float32 or bfloat16 (xdt); wdt WD_FP8: s13 [El, 2 ceil(I/br), ceil(H/bk)] (gate's scale
   rows, then up's), s2 [El, ceil(H/br), ceil(I/bk)] float32 (moe/fp8.py quantize_experts_fp8); WD_FP4: w13
   [El, 2I, H/2], w2 [El, H, I/2] e2m1 pairs, s13 [El, 2I, H/32], s2 [El, H, I/32] e8m0 bytes (H, I multiples
   of 32); else s13, s2 NULL. limit > 0: the clamped SwiGLU (gate <= limit, |up| <= limit: DeepSeek-V4's
   swiglu_limit); 0: none */
WD_INTERNAL int64_t experts(const void *x, int64_t xdt, int64_t T, int64_t H, int64_t I, int64_t El, const void *w13,
                            const void *w2, int64_t wdt, const void *s13, const void *s2, int64_t br, int64_t bk,
                            const int64_t *ids, const float *wts, int64_t k, float *out, int64_t *iscratch,
                            float *scratch, float limit);
WD_INTERNAL void swiglu(const float *x, int64_t T, int64_t H, const void *sg, const void *su, const void *sd,
                        int64_t wdt, int64_t Is, float *y, float *scratch);
/* norm_rope.c */
WD_INTERNAL void rmsnorm(const float *x, int64_t ldx, const void *w, int64_t wdt, float *y, int64_t ldy, int64_t M,
                         int64_t N, float eps);
WD_INTERNAL void rope(const float *x, int64_t T, int64_t Hh, int64_t R, int64_t sxt, int64_t sxh, const float *cos,
                      const float *sin, float *y, int interleave);
/* mla_decode.c */
WD_INTERNAL int64_t mla_decode(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const void *pool,
                               int64_t pdt, int64_t num_blocks, const int64_t *table, int64_t max_blocks, const int32_t *lens,
                               int64_t max_len, int64_t bs, float scale, float *out, float *scratch,
                               const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t group,
                               float *kb, int64_t fp4, int64_t toff);
/* mla_decode_avx2.c: mla_decode.c's vector loops on 8-float AVX2 + FMA vectors where WD_AVX2 (mla_decode.c calls them
   then): packed fp8 / fp4 rows [first, first + n) dequantised into kb [n, D]; one head's softmax in place (returns
   1 / sum); o [Nh, C] += p [Nh, nj] (rows L apart) @ nj float32 (blk) or bfloat16 (blk16) rows [:, :C] */
WD_INTERNAL const float *fp8_rows_avx2(const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t rdt,
                                       int64_t group, int64_t C, int64_t D, int64_t first, int64_t n, float *kb);
WD_INTERNAL const float *fp4_rows_avx2(const uint8_t *pool8, int64_t W, int64_t soff, int64_t toff, int64_t roff,
                                       int64_t rdt, int64_t C, int64_t D, int64_t first, int64_t n, float *kb);
WD_INTERNAL float softmax_row_avx2(float *s, int64_t L, float scale);
WD_INTERNAL void pv_rows_avx2(const float *blk, const uint16_t *blk16, int64_t D, int64_t nj, const float *p, int64_t L,
                              float *o, int64_t C, int64_t Nh);
/* mla_amx.c: mla_decode over a bfloat16 pool (read in place) on AMX tiles; 0 (nothing done) when it cannot (D or C
   not a multiple of 32, no scratch): the caller runs its own loops then. The lengths and block ids are the
   caller's to check first. */
WD_INTERNAL int mla_decode_amx(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const uint16_t *pool,
                               const int64_t *table, int64_t max_blocks, const int32_t *lens, int64_t max_len,
                               int64_t bs, float scale, float *out);
/* route.c */
WD_INTERNAL void route(const float *x, int64_t T, int64_t H, const float *w, int64_t E, const float *bias,
                       int sigmoid, int method, int64_t G, int64_t topk_group, int64_t k, int norm, float scale,
                       float *logits, int64_t *ids, float *wts);

/* ---- a decoder layer's weights, made once per layer (cpu/fused.py MlaWeights, MoeWeights, MlpWeights) ---- */

/* wq is q_b_proj [N (dn+R), Q] (Q > 0, after wqa [Q, H]) or q_proj [N (dn+R), H] (Q = 0); wkvb kv_b_proj
   [N (dn+dv), C]; the norms' weights in_w, post_w [H], qa_w [Q], kva_w [C]. The norms, wkvb (and W_UK^T) of
   dtype wdt; the projections wqa, wq, wkva, wo of dtype pwdt (wdt, or WD_FP8: wd_fp8_mat pointers). */
typedef struct {
    const void *in_w, *post_w, *wqa, *qa_w, *wq, *wkva, *kva_w, *wkvb, *wo;
    float in_eps, post_eps, qa_eps, kva_eps, scale;
    int64_t H, Q, N, dn, R, C, dv, interleave, wdt, pwdt;
} wd_mla_weights;

/* the router (gw [E, H], gbias [E] or NULL, float32, its settings as wd_route_args'), the experts (w13
   [E, 2I, H], w2 [E, H, I], every one local) and the shared experts' SwiGLU (sg, su [Is, H], sd [H, Is]; sg
   NULL: none), the experts of dtype wdt (WD_FP8: with their block scales s13, s2 in br x bk blocks, as
   wd_experts_args), the shared experts' of dtype sdt (WD_FP8: wd_fp8_mat pointers) */
typedef struct {
    const float *gw, *gbias;
    const void *w13, *w2, *sg, *su, *sd;
    float scale;
    int64_t H, E, I, Is, k, G, topk_group, sigmoid, method, norm, wdt;
    const float *s13, *s2;
    int64_t br, bk, sdt;
} wd_moe_weights;

/* a dense layer's SwiGLU MLP (weights of dtype wdt; WD_FP8: wd_fp8_mat pointers) */
typedef struct {
    const void *sg, *su, *sd;
    int64_t H, Is, wdt;
} wd_mlp_weights;

/* one decoder layer of wd_decode_stack: its structs (mlp NULL for an MoE layer, moe NULL for a dense one),
   W_UK^T [N, C, dn], its cache pool [S, D] of dtype pdt and EPLB counts [E] (or NULL) */
typedef struct {
    const wd_mla_weights *mla;
    const void *wuk_t;
    void *pool;
    int64_t S, pdt;
    const wd_moe_weights *moe;
    const wd_mlp_weights *mlp;
    int64_t *load;
} wd_layer_desc;

/* ---- the exported kernels: one argument struct each ---- */

/* y [M, N] = w * x * rsqrt(mean(x^2) + eps) per row (w of dtype wdt; x, y float32 or bfloat16: xdt, ydt, computed
   in float32 a row at a time). Returns 0, or -1 (nothing written) when there was no memory for a row's float32 copy. */
typedef struct {
    const void *x;
    const void *w;
    void *y;
    int64_t ldx, ldy, M, N, wdt, xdt, ydt;
    float eps;
} wd_rmsnorm_args;
int64_t wd_rmsnorm(const wd_rmsnorm_args *a);

/* y [T, Hh, R] contiguous = x [T, Hh, R] (strides sxt, sxh; unit last) rotated by cos/sin [T, R/2]
   contiguous. interleave: pairs (x[2i], x[2i+1]); else halves (x[i], x[i + R/2]). x, y float32 or bfloat16 (xdt,
   ydt; float32 inside). Returns 0, or -1 (nothing written) without memory for a token's float32 copy. */
typedef struct {
    const void *x, *cos, *sin;
    void *y;
    int64_t T, Hh, R, sxt, sxh, interleave, xdt, ydt;
} wd_rope_args;
int64_t wd_rope(const wd_rope_args *a);

/* y [B, M, N] = x [B, M, K] @ w [B, N, K]^T (batch strides sxb, swb, syb; row strides ldx, ldw, ldy), w of
   dtype wdt, x float32 or bfloat16 (xdt: read as is on AMX tiles, else widened exactly). Returns 0, or -1 when
   there was no memory to widen a bfloat16 x (y incomplete). */
typedef struct {
    const void *x;
    const void *w;
    float *y;
    int64_t B, sxb, ldx, swb, ldw, syb, ldy, M, N, K, wdt, xdt;
} wd_bmm_nt_args;
int64_t wd_bmm_nt(const wd_bmm_nt_args *a);

/* The bfloat16 dot products (AVX512-BF16) for bfloat16 weights: want 1 on (when the CPU has them), 0 off
   (the widening path: tests force it), -1 unchanged. Returns whether they are on. */
typedef struct {
    int64_t want, supported;
} wd_bf16_dot_args;
int64_t wd_bf16_dot(wd_bf16_dot_args *a);

/* AMX tiles for bfloat16 weights (gemm_amx.c) and a bfloat16 latent cache (mla_amx.c), under the dot products (off
   with them): want 1 on (where the CPU and the kernel allow), 0 off, -1 unchanged. Returns whether they are on;
   gemm_calls, mla_calls: the GEMM and paged-decode calls that ran on the tiles since the library was loaded. */
typedef struct {
    int64_t want, supported, gemm_calls, mla_calls, fp8_parts;   /* fp8_parts: bfloat16 parts of x, summed over FP8 GEMMs */
} wd_amx_args;
int64_t wd_amx(wd_amx_args *a);

/* Routed experts: out [T, H] (float32) += sum over slots of wts * expert(x), x float32 or bfloat16 (xdt). ids [T, k]
   local ids (-1: on another rank). iscratch: 2 (El + 1) + T k ints; scratch: T (2H + 3I) floats (WD_FP4: +
   FP4_XP(T k, max(H, I))). Returns 0, or -1 - p for the first pair p whose id is >= El (nothing is computed
   then). w13, w2 of dtype wdt; WD_FP8: their block scales s13, s2 in br x bk blocks (the experts() prototype
   above gives their shapes; bk a multiple of 16; else, or without them: INT64_MIN, nothing computed); WD_FP4:
   their e8m0 scales s13, s2 (H and I multiples of 32; else, or without them: INT64_MIN). limit > 0: clamped
   SwiGLU (experts() above). */
typedef struct {
    const void *x;
    const void *w13, *w2;
    const float *wts;
    const int64_t *ids;
    float *out, *scratch;
    int64_t *iscratch;
    const void *s13, *s2;
    int64_t T, H, I, El, k, wdt, br, bk, xdt;
    float limit;
} wd_experts_args;
int64_t wd_experts(const wd_experts_args *a);

/* FP8 block-quantised weights (gemm_fp8.c): W [N, K] = w (e4m3 bytes, rows ldw apart) times s [ceil(N/br),
   ceil(K/bk)] (rows lds apart), bk a multiple of 16. x given: y [M, N] float32 (rows ldy apart) = x [M, K]
   (rows ldx apart) @ W^T. x NULL: y = W [N, K] itself, rows ldy apart, float32 or bfloat16 (odt: WD_F32,
   WD_BF16), for the big-batch GEMMs that run on BLAS. Returns 0, or -1 (nothing done) for a bad block. */
typedef struct {
    const float *x;
    const uint8_t *w;
    const float *s;
    void *y;
    int64_t M, N, K, ldx, ldw, lds, ldy, br, bk, odt;
} wd_linear_fp8_args;
int64_t wd_linear_fp8(const wd_linear_fp8_args *a);

/* FP4 weights (gemm_fp4.c): W [N, K] = w (e2m1 codes two a byte, rows ldw bytes apart) times s (an e8m0 byte
   per 32 values along K, [N, K/32], rows lds apart), K a multiple of 32. x given: y [M, N] float32 (rows ldy
   apart) = x [M, K] (rows ldx apart) @ W^T. x NULL: y = W [N, K] itself, rows ldy apart, float32 or bfloat16
   (odt). xp: M * ceil(K/128) * 128 floats of scratch (x given). Returns 0, or -1 (nothing done) when K is not a
   multiple of 32 or xp is missing. */
typedef struct {
    const float *x;
    const uint8_t *w, *s;
    void *y;
    float *xp;
    int64_t M, N, K, ldx, ldw, lds, ldy, odt;
} wd_linear_fp4_args;
int64_t wd_linear_fp4(const wd_linear_fp4_args *a);

/* Absorbed MLA decode over the paged latent cache: out [B, Nh, C] from q [B, Nh, D], pool [num_blocks bs,
   D], table [B, max_blocks], lens [B] (1 .. max_len). scratch: Nh (max_len + 1) floats. pool8 (else NULL):
   the cache as packed fp8 rows of W bytes (scales at soff, one per `group` values, the RoPE at roff),
   dequantised through kb [min(bs, 16), D], its RoPE part of dtype pdt; fp4 1: packed fp4 rows instead (e2m1
   codes two a byte, an e4m3 scale byte per 16 values at soff, the token's float32 scale at toff, group
   unused); else pool of dtype pdt (read in place). Returns 0, or -1 (nothing computed) for a length or
   block id out of range. */
typedef struct {
    const float *q;
    const void *pool;
    const int64_t *table;
    const int32_t *lens;
    float *out, *scratch;
    const uint8_t *pool8;
    float *kb;
    int64_t B, Nh, D, C, num_blocks, max_blocks, max_len, bs, W, soff, roff, group, pdt, fp4, toff;
    float scale;
} wd_mla_decode_args;
int64_t wd_mla_decode(const wd_mla_decode_args *a);

/* The router (moe/gate.py Gate): logits [T, E] (scratch) = x [T, H] @ w [E, H]^T, scores (softmax, or
   sigmoid when sigmoid), + bias [E] (or NULL) to choose; method 0 greedy, 1 group max, 2 group top-two
   sum over G groups keeping topk_group; ids, wts [T, k] (renormalised when norm, times scale). */
typedef struct {
    const float *x, *w, *bias;
    float *logits, *wts;
    int64_t *ids;
    int64_t T, H, E, G, topk_group, k, sigmoid, method, norm;
    float scale;
} wd_route_args;
void wd_route(const wd_route_args *a);

/* One decode step of an MLA layer around its attention (fused.c). x [T, H], cos/sin [T, R/2], pool [S, D]
   of dtype pdt, slots [T], table [T, max_blocks], lens [T] -> h, mlp_in [T, H]. buf: see fused.c. Returns 0,
   -1 (a length or block id out of range, nothing attended), -2 - t (token t's slot outside the pool,
   nothing written). */
typedef struct {
    const wd_mla_weights *w;
    const void *wuk_t;
    const float *x, *cos, *sin;
    void *pool;
    const int64_t *slots, *table;
    const int32_t *lens;
    float *h, *mlp_in, *buf;
    int64_t T, S, max_blocks, max_len, bs, pdt;
} wd_mla_layer_args;
int64_t wd_mla_layer(const wd_mla_layer_args *a);

/* An MoE layer's half on one EP rank: out = h + MoE(x), ids, wts [T, k]; load [E] (or NULL) += 1 per
   chosen id. Returns 0. */
typedef struct {
    const wd_moe_weights *w;
    const float *h, *x;
    int64_t *load, *ids, *iscratch;
    float *out, *wts, *scratch;
    int64_t T;
} wd_moe_layer_args;
int64_t wd_moe_layer(const wd_moe_layer_args *a);

/* A dense layer's MLP half: out = h + MLP(x). scratch: T (H + 2 Is) floats. */
typedef struct {
    const wd_mlp_weights *w;
    const float *h, *x;
    float *out, *scratch;
    int64_t T;
} wd_mlp_layer_args;
void wd_mlp_layer(const wd_mlp_layer_args *a);

/* A decode step's L decoder layers (fused.c): x0 [T, H] -> out [T, H]; ids, wts [n_moe, T, k]. Returns 0,
   or a layer's wd_mla_layer error code with *failed = its layer. */
typedef struct {
    const wd_layer_desc *layers;
    const float *x0, *cos, *sin;
    const int64_t *slots, *table;
    const int32_t *lens;
    float *out, *wts, *buf;
    int64_t *ids, *ibuf, *failed;
    int64_t L, T, max_blocks, max_len, bs;
} wd_decode_stack_args;
int64_t wd_decode_stack(const wd_decode_stack_args *a);

/* The passes of a multi-token-prediction layer (fused.c; engine/model/mtp.py). The first: n_in rows in; with embed,
   their input x = eh_proj([enorm(embed[ids]) ; hnorm(prev)]) ([n_in, 2H] -> [n_in, H]; embed [V, H] of dtype edt),
   without it x = prev. Rows rest[0..n_rest) write their cache entries only (MLA.write_entries: the layer's input
   norm, kv_a, its norm and RoPE at rest_cos/rest_sin, into the pool's rows rest_slots); rows out_rows[0..T) (NULL:
   all, T = n_in) run the decoder layer (as decode_stack's, L = 1), then the argmax of head(norm(out)), the first of
   equal maxima (the norms, eh_proj and head [V, H] of dtype wdt): tok[t * passes]. Each later pass j (1 ..
   passes - 1) feeds row t's previous draft and layer output back in at its next position: slot nslots, length
   nlens, RoPE ncos/nsin (rows [T, passes - 1], of R/2 floats for the RoPE); a row whose slot is -1 stops there
   (its drafts from then on -1), and every later one too. out [T, H]: each row's last layer output. max_len: the
   longest length of every pass. buf: n_in 3 H + T H + max(n_rest (H + 3 (C+R)), 4 T H + the layer's scratch, T
   (H + V)) floats; ibuf: the MoE half's int scratch; with passes > 1, pf: T (3 H + R) floats, pi: T (5 +
   max_blocks) int64s. Returns decode_stack's code, or -2 - r when input row r's slot is outside the pool (none of
   the rest rows' entries written when r is one of them; later passes' slots are the caller's to check). */
typedef struct {
    const wd_layer_desc *layer;
    const int64_t *ids;
    const void *embed, *enorm_w, *hnorm_w, *eh_w, *norm_w, *head_w;
    const float *prev, *cos, *sin, *rest_cos, *rest_sin, *ncos, *nsin;
    const int64_t *slots, *table, *rest, *rest_slots, *out_rows, *nslots;
    const int32_t *lens, *nlens;
    float *out, *wts, *buf, *pf;
    int64_t *tok, *moe_ids, *ibuf, *pi, *failed;
    float enorm_eps, hnorm_eps, norm_eps, pad;
    int64_t T, n_in, n_rest, passes, H, V, edt, wdt, max_blocks, max_len, bs;
} wd_mtp_pass_args;
int64_t wd_mtp_pass(const wd_mtp_pass_args *a);

/* DeepSeek-V4's hyper-connection entry (layers/hyper_connection.py HyperConnection.weights + collapse; head: HyperHead,
   pre only): x [T, n, H] (xdt) -> pre [T, n], post [T, n], comb [T, n, n] float32, y [T, H] (ydt) = sum_k pre_k x_k.
   fn [J, n H] (J = (2 + n) n, or n for the head), base [J], scale [3] (head: [1]), float32. Returns 0, or -1 (nothing
   written) without memory for the float32 copies. */
typedef struct {
    const void *x;
    const float *fn, *base, *scale;
    float *pre, *post, *comb;
    void *y;
    int64_t T, n, H, iters, head, xdt, ydt;
    float eps, norm_eps;
} wd_hc_enter_args;
int64_t wd_hc_enter(const wd_hc_enter_args *a);

/* ... and its exit: y [T, n, H] (xdt) = post [T, n] * out [T, H] (odt) + comb [T, n, n]^T x [T, n, H] (xdt), float32
   inside, one rounding. y must not overlap x. */
typedef struct {
    const void *x, *out;
    const float *post, *comb;
    void *y;
    int64_t T, n, H, xdt, odt;
} wd_hc_leave_args;
int64_t wd_hc_leave(const wd_hc_leave_args *a);

/* ---- the layout of every struct above, for the load-time check (layouts.c) ---- */

/* one field (or, with field NULL, the struct's sizeof in size); the table ends with name NULL */
typedef struct {
    const char *name, *field;
    int64_t offset, size;
} wd_layout;
const wd_layout *wd_layouts(void);

#endif
