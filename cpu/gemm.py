"""Streamed small-batch GEMM and the fused routed experts, in C (built by cpu/build.py), each launcher
below the source it runs.

Why: a decode step multiplies every weight it uses by a handful of rows, so its speed is the speed at
which the weights stream from memory. On CPU, BLAS small-M GEMMs (MKL via F.linear / bmm) reach about
a third of a plain read's bandwidth (bench/decode_vs_hf.py measures both), and even reading two rows
of a matrix at once is slower than reading one after the other. These kernels read each weight row
once, front to back, doing all of the row's work while it is in L1.

Legend: M rows of activations (tokens, pairs, heads), N output features, K input features, T tokens,
H hidden, I moe_intermediate_size, El local experts, k top-k. Float32 CPU tensors, last dim contiguous.
  linear(x [M, K], w [N, K]) -> [M, N]                    = F.linear(x, w)
  bmm_nt(x [B, M, K], w [B, N, K]) -> [B, M, N]           = x @ w.transpose(1, 2)
  experts(x, w13, w2, topk_ids, topk_weights) -> [T, H]   = Experts.forward_reference (moe/experts.py)
Tests: tests/cpu/.
"""
from __future__ import annotations

import ctypes

import torch

from .build import library, register

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));
static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, 64); }
static inline v16 bc(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
/* keeps v in a register: without it GCC reloads a vector for every FMA that uses it */
#define KEEP(v) __asm__("" : "+v"(v))
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

/* part[j] (16 lanes whose sum is x[j] . wr) for MB rows of x. Two accumulators per row halve the FMA
   dependency chains (one row of x too: its weights then stream ~13 % faster, measured A/B; four
   accumulators stream slower). Features past the last multiple of 16: one zero-padded step. */
#define ROW(MB)                                                                                    \
static inline void row_##MB(const float *x, int64_t ldx, const float *wr, int64_t K, v16 *part) {   \
    v16 a[MB], b[MB];                                                                              \
    for (int j = 0; j < MB; j++) a[j] = b[j] = bc(0);                                              \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    for (; k + 32 <= K16; k += 32) {                                                               \
        v16 w0 = ld(wr + k), w1 = ld(wr + k + 16);                                                 \
        for (int j = 0; j < MB; j++) {                                                             \
            a[j] += w0 * ld(x + j * ldx + k);                                                      \
            b[j] += w1 * ld(x + j * ldx + k + 16);                                                 \
        }                                                                                          \
    }                                                                                              \
    for (; k < K16; k += 16) {                                                                     \
        v16 w0 = ld(wr + k);                                                                       \
        for (int j = 0; j < MB; j++) a[j] += w0 * ld(x + j * ldx + k);                             \
    }                                                                                              \
    if (k < K) {                                                                                   \
        v16 w0 = ld_part(wr + k, K - k);                                                           \
        for (int j = 0; j < MB; j++) a[j] += w0 * ld_part(x + j * ldx + k, K - k);                 \
    }                                                                                              \
    for (int j = 0; j < MB; j++) part[j] = a[j] + b[j];                                            \
}
ROW(1) ROW(2) ROW(4) ROW(8)

/* the partial sums of all m rows of x (m <= MCHUNK) against one row of w, in blocks of 8, 4, 2, 1 */
#define MCHUNK 32
static inline void row_all(const float *x, int64_t ldx, int64_t m, const float *wr, int64_t K, v16 *part) {
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) row_8(x + j * ldx, ldx, wr, K, part + j);
    if (j + 4 <= m) { row_4(x + j * ldx, ldx, wr, K, part + j); j += 4; }
    if (j + 2 <= m) { row_2(x + j * ldx, ldx, wr, K, part + j); j += 2; }
    if (j < m) row_1(x + j * ldx, ldx, wr, K, part + j);
}

/* Four or more rows of x: per weight vector, the single-row form loads a vector of x for every FMA, and
   from 4 rows on those loads, not the weight stream, set the pace (measured on the routed experts: an
   expert with 4 tokens streamed its weights at ~15 GB/s against ~25 with 1-3). Blocks of 4 rows of w x
   MB rows of x share every load (16 accumulators): x is read once per 4 rows of w instead of once per
   row. With many rows the FMAs are the bottleneck, and this is their best form too. */
#define BLOCK4_STEP(MB, LD)                                                                        \
        {                                                                                          \
            v16 w0 = LD(w + k), w1 = LD(w + ldw + k), w2 = LD(w + 2 * ldw + k), w3 = LD(w + 3 * ldw + k); \
            KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3);                                                \
            for (int j = 0; j < MB; j++) {                                                         \
                v16 xv = LD(x + j * ldx + k);                                                      \
                KEEP(xv);                                                                          \
                acc[j][0] += w0 * xv; acc[j][1] += w1 * xv; acc[j][2] += w2 * xv; acc[j][3] += w3 * xv; \
            }                                                                                      \
        }
#define LD_FULL(p) ld(p)
#define LD_TAIL(p) ld_part(p, K - k)
#define BLOCK4(MB)                                                                                 \
static void block4_##MB(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,        \
                        int64_t ldy, int64_t K, int pf) {                                          \
    v16 acc[MB][4];                                                                                \
    for (int j = 0; j < MB; j++) for (int r = 0; r < 4; r++) acc[j][r] = bc(0);                    \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    if (pf)                                                                                        \
        for (; k < K16; k += 16) {                                                                 \
            for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + k, 0, 2);                \
            BLOCK4_STEP(MB, LD_FULL)                                                               \
        }                                                                                          \
    else                                                                                           \
        for (; k < K16; k += 16) BLOCK4_STEP(MB, LD_FULL)                                          \
    if (k < K) BLOCK4_STEP(MB, LD_TAIL)                                                            \
    for (int j = 0; j < MB; j++) {                                                                 \
        v16 s = reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);                               \
        for (int r = 0; r < 4; r++) y[j * ldy + r] = s[4 * r];                                     \
    }                                                                                              \
}
BLOCK4(2) BLOCK4(3) BLOCK4(4)

/* y [M, N] (rows ldy apart) = x [M, K] @ w [N, K]^T. One to three rows of x (memory-bound): the rows of w
   are read once each, front to back (never two at once: two streams read slower than one), and all of
   a row's work is done while it is in L1; four rows' partial sums are reduced together. Four or more
   rows: BLOCK4 (measured A/B on the experts kernel, the same build's 1-row case as the control: 4 rows
   0.71-0.83x the time, 6-7 rows 0.63-0.80x, 5 rows as 3 + 2 even, 9 and 13 rows 0.91-0.95x). */
static void linear(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K) {
    v16 part[4][MCHUNK];
    int64_t n4 = N & ~(int64_t)3;
    if (M >= 4) {
        for (int64_t n = 0; n < n4; n += 4)
            for (int64_t m = 0; m < M;) {
                /* blocks of 4 rows of x; five left: 3 + 2 (a block of one reads 4 weight rows for 4 FMAs) */
                int64_t left = M - m, mb = left == 5 ? 3 : left < 4 ? left : 4;
                const float *xm = x + m * ldx, *wn = w + n * ldw;
                float *ym = y + m * ldy + n;
                switch (mb) {
                    case 2: block4_2(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    case 3: block4_3(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    default: block4_4(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N);
                }
                m += mb;
            }
    } else {
        for (int64_t n = 0; n < n4; n += 4) {
            for (int r = 0; r < 4; r++) row_all(x, ldx, M, w + (n + r) * ldw, K, part[r]);
            for (int64_t j = 0; j < M; j++) {
                v16 s = reduce4(part[0][j], part[1][j], part[2][j], part[3][j]);
                for (int r = 0; r < 4; r++) y[j * ldy + n + r] = s[4 * r];
            }
        }
    }
    for (int64_t n = n4; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            int64_t m = M - m0 < MCHUNK ? M - m0 : MCHUNK;
            row_all(x + m0 * ldx, ldx, m, w + n * ldw, K, part[0]);
            for (int64_t j = 0; j < m; j++) {
                float t = 0;
                for (int l = 0; l < 16; l++) t += part[0][j][l];
                y[(m0 + j) * ldy + n] = t;
            }
        }
}

void wd_bmm_nt(int64_t B, const float *x, int64_t sxb, int64_t ldx, const float *w, int64_t swb, int64_t ldw,
               float *y, int64_t syb, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    for (int64_t b = 0; b < B; b++) linear(x + b * sxb, ldx, w + b * swb, ldw, y + b * syb, ldy, M, N, K);
}


/* The first PREFETCH_HEAD floats (8 KiB) of a matrix the caller reads next, asked into L2 while it
   finishes the current one: the hardware prefetcher restarts at every new matrix, ~100 a layer in a
   decode step's experts (measured: the decode benchmark's step ~2.5 % faster, an in-process A/B of
   the two builds, 6 rounds; in the experts alone 2 or 16 KiB gained less). */
#define PREFETCH_HEAD 2048
static inline void prefetch_head(const float *w, int64_t n) {
    for (int64_t i = 0; i < PREFETCH_HEAD && i < n; i += 16) __builtin_prefetch(w + i, 0, 2);
}

/* Routed experts. ids [T, k] local expert ids (-1: on another rank), wts [T, k]. The (token, slot)
   pairs are counting-sorted by expert (stable: the reference's order); per expert with tokens: gather
   them, h = x @ w13[e]^T, a = silu(gate) * up, y = a @ w2[e]^T, out[token] += weight * y.
   iscratch: 2 * (El + 1) + T * k ints; scratch: T * (2H + 3I) floats. Returns 0, or -1 - p for the
   first pair p whose id is >= El (nothing is computed then). */
int64_t wd_experts(const float *x, int64_t T, int64_t H, int64_t I, int64_t El, const float *w13,
                   const float *w2, const int64_t *ids, const float *wts, int64_t k, float *out,
                   int64_t *iscratch, float *scratch) {
    int64_t P = T * k, *start = iscratch, *fill = start + El + 1, *order = fill + El + 1;
    memset(start, 0, (El + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] >= El) return -1 - p;
        if (ids[p] >= 0) start[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < El; e++) start[e + 1] += start[e];
    memcpy(fill, start, El * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0) order[fill[ids[p]]++] = p;
    for (int64_t e = 0; e < El; e++) {
        int64_t p0 = start[e], np = start[e + 1] - p0;
        if (!np) continue;
        float *xs = scratch, *h = xs + np * H, *a = h + np * 2 * I, *y = a + np * I;
        for (int64_t p = 0; p < np; p++) memcpy(xs + p * H, x + order[p0 + p] / k * H, H * sizeof(float));
        prefetch_head(w2 + e * H * I, H * I);
        linear(xs, H, w13 + e * 2 * I * H, H, h, 2 * I, np, 2 * I, H);
        for (int64_t p = 0; p < np; p++) {
            const float *g = h + p * 2 * I, *u = g + I;
            float *ap = a + p * I;
            int64_t i = 0;
            for (; i + 16 <= I; i += 16) {
                v16 gv = ld(g + i);
                st(ap + i, gv / (bc(1.0f) + vexp(-gv)) * ld(u + i));
            }
            for (; i < I; i++) ap[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        int64_t next = e + 1;
        while (next < El && start[next + 1] == start[next]) next++;
        if (next < El) prefetch_head(w13 + next * 2 * I * H, 2 * I * H);
        linear(a, I, w2 + e * H * I, I, y, H, np, H, I);
        for (int64_t p = 0; p < np; p++) {
            float wt = wts[order[p0 + p]], *o = out + order[p0 + p] / k * H;
            for (int64_t c = 0; c < H; c++) o[c] += wt * y[p * H + c];
        }
    }
    return 0;
}

"""
P, I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {"wd_bmm_nt": ([I, P, I, I, P, I, I, P, I, I, I, I, I], None),
              "wd_experts": ([P, I, I, I, I, P, P, P, P, I, P, P, P], I)}
register(SOURCE, SIGNATURES)


def check_float32(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be a float32 CPU tensor with {dim} dims and a contiguous last dim, got "
                         f"{t.dtype} {t.device.type} shape {tuple(t.shape)} strides {t.stride()}")


def bmm_nt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, M, K], w [B, N, K] (any batch and row strides) -> [B, M, N] = x @ w^T."""
    check_float32("x", x, 3)
    check_float32("w", w, 3)
    B, M, K = x.shape
    if w.shape[0] != B or w.shape[2] != K:
        raise ValueError(f"bmm_nt: x {tuple(x.shape)} and w {tuple(w.shape)} need the same batch and K")
    N = w.shape[1]
    out = torch.empty(B, M, N, dtype=x.dtype) if out is None else out
    check_float32("out", out, 3)
    if tuple(out.shape) != (B, M, N):
        raise ValueError(f"bmm_nt: out is {tuple(out.shape)}, expected {(B, M, N)}")
    if out.numel() and K:
        library().wd_bmm_nt(B, x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), w.stride(0), w.stride(1),
                            out.data_ptr(), out.stride(0), out.stride(1), M, N, K)
    elif out.numel():
        out.zero_()
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] = F.linear(x, w). Lean: decode calls it for every projection."""
    (M, K), (N, K2) = x.shape, w.shape
    if not (x.dtype == w.dtype == torch.float32 and K == K2 and x.stride(1) == 1 and w.stride(1) == 1
            and not x.is_cuda and not w.is_cuda):
        check_float32("x", x, 2)
        check_float32("w", w, 2)
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} need the same K")
    out = torch.empty(M, N)
    if M and N and K:
        library().wd_bmm_nt(1, x.data_ptr(), 0, x.stride(0), w.data_ptr(), 0, w.stride(0), out.data_ptr(), 0, N,
                            M, N, K)
    elif M and N:
        out.zero_()
    return out


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [El, 2I, H], w2 [El, H, I] (contiguous), topk_ids [T, k] local ids (-1: elsewhere),
    topk_weights [T, k] -> [T, H]: only the experts that have tokens are read. No host sync."""
    check_float32("x", x, 2)
    check_float32("w13", w13, 3)
    check_float32("w2", w2, 3)
    T, H = x.shape
    El, I2, H2 = w13.shape
    if H2 != H or tuple(w2.shape) != (El, H, I2 // 2) or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} must be "
                         f"[T, H], [El, 2I, H], [El, H, I], weights contiguous")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"experts: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={T}, k]")
    if topk_ids.dtype != torch.int64:
        raise ValueError(f"experts: topk_ids must be int64, got {topk_ids.dtype}")
    x, ids, wts = x.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous()
    I, k = I2 // 2, ids.shape[1]
    out = torch.zeros_like(x)
    if T and k:
        iscratch, scratch = torch.empty(2 * (El + 1) + T * k, dtype=torch.int64), torch.empty(T * (2 * H + 3 * I))
        rc = library().wd_experts(x.data_ptr(), T, H, I, El, w13.data_ptr(), w2.data_ptr(), ids.data_ptr(),
                                  wts.data_ptr(), k, out.data_ptr(), iscratch.data_ptr(), scratch.data_ptr())
        if rc < 0:   # an id past the last local expert: the kernel would have read past the weights
            raise ValueError(f"experts: topk_ids holds local id {int(ids.view(-1)[-1 - rc])}, there are {El} "
                             f"local experts")
    return out


