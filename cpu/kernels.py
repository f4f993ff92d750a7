"""C kernels for the CPU decode path, each launcher below the source it runs (built by cpu/build.py).

Why they exist: a decode step reads every weight it uses once for a handful of rows, so its speed is
the speed at which weights stream from memory. On CPU, BLAS small-M GEMMs (MKL via F.linear / bmm)
reach about a third of a plain read's bandwidth (`bench/decode_vs_hf.py` measures both), and
reading two rows of a matrix at once is already slower than reading one after the other. These
kernels read each weight row once, front to back, and do all the row's work while it is in L1.

Legend: M rows of activations (tokens, pairs, heads), N output features, K input features,
T tokens, H hidden, I moe_intermediate_size, El local experts, P (token, expert) pairs, S segments
(experts with tokens), B sequences, Nh heads, D = C + R latent width, C kv_lora_rank.
Every kernel takes float32 CPU tensors whose last dimension is contiguous; the launchers check.
  linear(x [M, K], w [N, K]) -> [M, N]                      = F.linear(x, w)
  bmm_nt(x [B, M, K], w [B, N, K]) -> [B, M, N]             = x @ w.transpose(1, 2)
  experts(x, w13, w2, topk_ids, topk_weights) -> [T, H]      = Experts.forward_reference
  mla_decode(q, kv_pool, block_table, seq_lens, ...) -> [B, Nh, C] = paged_decode_reference
References: moe/experts.py (forward_reference), attention_mla/paged_decode.py; tests/cpu/.
"""
from __future__ import annotations

import ctypes

import torch

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

/* part[j] (16 lanes whose sum is x[j] . wr) for MB rows of x. From two rows of x on, two accumulators
   per row halve the FMA dependency chains. Features past the last multiple of 16: one zero-padded step. */
#define ROW(MB)                                                                                    \
static inline void row_##MB(const float *x, int64_t ldx, const float *wr, int64_t K, v16 *part) {   \
    v16 a[MB], b[MB];                                                                              \
    for (int j = 0; j < MB; j++) a[j] = b[j] = bc(0);                                              \
    int64_t k = 0, K16 = K & ~(int64_t)15;                                                         \
    if (MB > 1)                                                                                    \
        for (; k + 32 <= K16; k += 32) {                                                           \
            v16 w0 = ld(wr + k), w1 = ld(wr + k + 16);                                             \
            for (int j = 0; j < MB; j++) {                                                         \
                a[j] += w0 * ld(x + j * ldx + k);                                                  \
                b[j] += w1 * ld(x + j * ldx + k + 16);                                             \
            }                                                                                      \
        }                                                                                          \
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

/* Many rows of x (M >= 8): the FMAs are the bottleneck, and x no longer fits in L1 beside the weights.
   Blocks of 4 rows of w x MB rows of x then share every load (16 accumulators): x is read once per 4
   rows of w instead of once per row. */
#define BLOCK4(MB)                                                                                 \
static void block4_##MB(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,        \
                        int64_t ldy, int64_t K, int pf) {                                          \
    v16 acc[MB][4];                                                                                \
    for (int j = 0; j < MB; j++) for (int r = 0; r < 4; r++) acc[j][r] = bc(0);                    \
    for (int64_t k = 0; k < K; k += 16) {                                                          \
        int64_t n = K - k < 16 ? K - k : 16;                                                       \
        v16 w0, w1, w2, w3;                                                                        \
        if (n == 16) { w0 = ld(w + k); w1 = ld(w + ldw + k); w2 = ld(w + 2 * ldw + k); w3 = ld(w + 3 * ldw + k); } \
        else { w0 = ld_part(w + k, n); w1 = ld_part(w + ldw + k, n); w2 = ld_part(w + 2 * ldw + k, n);          \
               w3 = ld_part(w + 3 * ldw + k, n); }                                                 \
        KEEP(w0); KEEP(w1); KEEP(w2); KEEP(w3);                                                    \
        if (pf) for (int r = 4; r < 8; r++) __builtin_prefetch(w + r * ldw + k, 0, 2);           \
        for (int j = 0; j < MB; j++) {                                                             \
            v16 xv = n == 16 ? ld(x + j * ldx + k) : ld_part(x + j * ldx + k, n);                  \
            KEEP(xv);                                                                              \
            acc[j][0] += w0 * xv; acc[j][1] += w1 * xv; acc[j][2] += w2 * xv; acc[j][3] += w3 * xv; \
        }                                                                                          \
    }                                                                                              \
    for (int j = 0; j < MB; j++) {                                                                 \
        v16 s = reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);                               \
        for (int r = 0; r < 4; r++) y[j * ldy + r] = s[4 * r];                                     \
    }                                                                                              \
}
BLOCK4(1) BLOCK4(2) BLOCK4(3) BLOCK4(4)

/* y [M, N] (rows ldy apart) = x [M, K] @ w [N, K]^T. Few rows of x (M < 8, memory-bound): the rows of w
   are read once each, front to back (never two at once: two streams read slower than one), and all of
   a row's work (up to MCHUNK rows of x, in L1) is done while it is in L1; four rows' partial sums are
   reduced together. Many rows: BLOCK4. */
static void linear(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K) {
    v16 part[4][MCHUNK];
    int64_t n4 = N & ~(int64_t)3;
    if (M >= 8) {
        for (int64_t n = 0; n < n4; n += 4)
            for (int64_t m = 0; m < M; m += 4) {
                const float *xm = x + m * ldx, *wn = w + n * ldw;
                float *ym = y + m * ldy + n;
                switch (M - m < 4 ? M - m : 4) {
                    case 1: block4_1(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    case 2: block4_2(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    case 3: block4_3(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N); break;
                    default: block4_4(xm, ldx, wn, ldw, ym, ldy, K, m == 0 && n + 8 <= N);
                }
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

/* Routed experts over pairs sorted by expert: segment s holds pairs seg_start[s] .. seg_start[s+1]-1
   of expert seg_expert[s]; pair p is token rows[p] with routing weight wts[p]. Per segment: gather
   its tokens, h = x @ w13[e]^T, a = silu(gate) * up, y = a @ w2[e]^T, out[row] += weight * y.
   scratch: max_seg * (2H + 3I) floats. */
void wd_experts(const float *x, int64_t H, int64_t I, const float *w13, const float *w2,
                const int64_t *seg_expert, const int64_t *seg_start, int64_t S,
                const int64_t *rows, const float *wts, float *out, float *scratch) {
    for (int64_t s = 0; s < S; s++) {
        int64_t e = seg_expert[s], p0 = seg_start[s], np = seg_start[s + 1] - p0;
        float *xs = scratch, *h = xs + np * H, *a = h + np * 2 * I, *y = a + np * I;
        for (int64_t p = 0; p < np; p++) memcpy(xs + p * H, x + rows[p0 + p] * H, H * sizeof(float));
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
        linear(a, I, w2 + e * H * I, I, y, H, np, H, I);
        for (int64_t p = 0; p < np; p++) {
            float wt = wts[p0 + p], *o = out + rows[p0 + p] * H;
            for (int64_t c = 0; c < H; c++) o[c] += wt * y[p * H + c];
        }
    }
}

/* Absorbed MLA decode over the paged latent cache, one query token per sequence: scores = q . latent
   over the sequence's blocks (read through the block table, never gathered), fp32 softmax, out =
   p @ latent[:, :C]. scratch: Nh * (max(lens) + 1) floats. */
void wd_mla_decode(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const float *pool,
                   const int64_t *table, int64_t max_blocks, const int64_t *lens, int64_t bs, float scale,
                   float *out, float *scratch) {
    int64_t C16 = C & ~(int64_t)15;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b];
        float *inv = scratch + Nh * L;
        const float *qb = q + b * Nh * D;
        float *ob = out + b * Nh * C, *sc = scratch;
        for (int64_t j0 = 0; j0 < L; j0 += bs) {
            const float *blk = pool + table[b * max_blocks + j0 / bs] * bs * D;
            linear(qb, D, blk, D, sc + j0, L, Nh, L - j0 < bs ? L - j0 : bs, D);
        }
        for (int64_t n = 0; n < Nh; n++) {       /* p = exp((s - max) * scale); the 1 / sum comes last */
            float *s = sc + n * L, mx = -INFINITY, sum = 0;
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
            inv[n] = 1.0f / sum;
        }
        memset(ob, 0, Nh * C * sizeof(float));
        for (int64_t j = 0; j < L; j++) {
            const float *row = pool + (table[b * max_blocks + j / bs] * bs + j % bs) * D;
            for (int64_t n = 0; n < Nh; n++) {
                float p = sc[n * L + j], *o = ob + n * C;
                v16 pv = bc(p);
                for (int64_t c = 0; c < C16; c += 16) st(o + c, ld(o + c) + pv * ld(row + c));
                for (int64_t c = C16; c < C; c++) o[c] += p * row[c];
            }
        }
        for (int64_t n = 0; n < Nh; n++)
            for (int64_t c = 0; c < C; c++) ob[n * C + c] *= inv[n];
    }
}
"""

_lib: ctypes.CDLL | None = None
_error: str | None = None


def unusable() -> str | None:
    """Why the CPU kernels cannot run here (no compiler, a build error), or None once they are loaded."""
    global _lib, _error
    if _lib is None and _error is None:
        from .build import BuildError, build
        try:
            lib = build("wideep_cpu", SOURCE)
        except BuildError as e:
            _error = str(e)
            return _error
        P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.wd_bmm_nt.argtypes = [I, P, I, I, P, I, I, P, I, I, I, I, I]
        lib.wd_experts.argtypes = [P, I, I, P, P, P, P, I, P, P, P, P]
        lib.wd_mla_decode.argtypes = [P, I, I, I, I, P, P, I, P, I, F, P, P]
        for f in (lib.wd_bmm_nt, lib.wd_experts, lib.wd_mla_decode):
            f.restype = None
        _lib = lib
    return _error


def unusable_for(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why these kernels cannot serve a model of `dtype` on `device`, or None (builds them when it could)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the device is {device}, not the CPU"
    if dtype != torch.float32:
        return f"the model dtype is {dtype}; the CPU kernels take float32"
    return unusable()


def _lib_or_raise() -> ctypes.CDLL:
    why = unusable()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are not usable: {why}")
    return _lib


def _check(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be a float32 CPU tensor with {dim} dims and a contiguous last dim, got "
                         f"{t.dtype} {t.device.type} shape {tuple(t.shape)} strides {t.stride()}")


def bmm_nt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, M, K], w [B, N, K] (any batch and row strides) -> [B, M, N] = x @ w^T."""
    _check("x", x, 3)
    _check("w", w, 3)
    B, M, K = x.shape
    if w.shape[0] != B or w.shape[2] != K:
        raise ValueError(f"bmm_nt: x {tuple(x.shape)} and w {tuple(w.shape)} need the same batch and K")
    N = w.shape[1]
    out = torch.empty(B, M, N, dtype=x.dtype) if out is None else out
    _check("out", out, 3)
    if tuple(out.shape) != (B, M, N):
        raise ValueError(f"bmm_nt: out is {tuple(out.shape)}, expected {(B, M, N)}")
    if out.numel() and K:
        _lib_or_raise().wd_bmm_nt(B, x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), w.stride(0), w.stride(1),
                                  out.data_ptr(), out.stride(0), out.stride(1), M, N, K)
    elif out.numel():
        out.zero_()
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] = F.linear(x, w). Lean: decode calls it for every projection."""
    (M, K), (N, K2) = x.shape, w.shape
    if not (x.dtype == w.dtype == torch.float32 and K == K2 and x.stride(1) == 1 and w.stride(1) == 1
            and not x.is_cuda and not w.is_cuda):
        _check("x", x, 2)
        _check("w", w, 2)
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} need the same K")
    out = torch.empty(M, N)
    if M and N and K:
        _lib_or_raise().wd_bmm_nt(1, x.data_ptr(), 0, x.stride(0), w.data_ptr(), 0, w.stride(0), out.data_ptr(), 0, N,
                                  M, N, K)
    elif M and N:
        out.zero_()
    return out


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [El, 2I, H], w2 [El, H, I] (contiguous), topk_ids [T, k] local ids (-1: elsewhere),
    topk_weights [T, k] -> [T, H]: only the experts that have tokens are read. No host sync."""
    _check("x", x, 2)
    _check("w13", w13, 3)
    _check("w2", w2, 3)
    T, H = x.shape
    El, I2, H2 = w13.shape
    if H2 != H or tuple(w2.shape) != (El, H, I2 // 2) or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} must be "
                         f"[T, H], [El, 2I, H], [El, H, I], weights contiguous")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"experts: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={T}, k]")
    x = x.contiguous()
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0).nonzero().squeeze(1)
    order = valid[flat[valid].argsort(stable=True)]                            # pair index, by expert
    counts = torch.bincount(flat[order], minlength=El)                         # [El]
    if counts.shape[0] > El:   # an id past the last local expert: the kernel would read past the weights
        raise ValueError(f"experts: topk_ids holds local ids up to {counts.shape[0] - 1}, there are {El} local experts")
    seg_expert = counts.nonzero().squeeze(1)                                   # [S] experts with tokens
    seg_start = torch.zeros(len(seg_expert) + 1, dtype=torch.int64)
    torch.cumsum(counts[seg_expert], 0, out=seg_start[1:])
    rows = (order // topk_ids.shape[1]).contiguous()
    wts = topk_weights.reshape(-1)[order].float().contiguous()
    out = torch.zeros_like(x)
    if len(seg_expert):
        I = I2 // 2
        scratch = torch.empty(T * (2 * H + 3 * I))   # a segment has at most T pairs (an expert once per token)
        _lib_or_raise().wd_experts(x.data_ptr(), H, I, w13.data_ptr(), w2.data_ptr(), seg_expert.data_ptr(),
                                   seg_start.data_ptr(), len(seg_expert), rows.data_ptr(), wts.data_ptr(),
                                   out.data_ptr(), scratch.data_ptr())
    return out


def mla_decode(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, kv_lora_rank: int, scale: float, max_len: int) -> torch.Tensor:
    """q [B, Nh, D] (absorbed: [q_nope W_UK, q_pe]), kv_pool [S, D], block_table [B, M] int64 block ids,
    seq_lens [B] int64 (each in 1 .. max_len; max_len a host int) -> [B, Nh, C] (fp32 softmax)."""
    _check("q", q, 3)
    _check("kv_pool", kv_pool, 2)
    B, Nh, D = q.shape
    if kv_pool.shape[1] != D or not 0 < kv_lora_rank <= D or not kv_pool.is_contiguous():
        raise ValueError(f"mla_decode: q {tuple(q.shape)}, kv_pool {tuple(kv_pool.shape)} (contiguous) and "
                         f"kv_lora_rank {kv_lora_rank} do not fit")
    if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int64 or block_table.dim() != 2 \
            or block_table.shape[0] != B or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"mla_decode: block_table [B={B}, M] and seq_lens [B] must be int64, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}, {seq_lens.dtype} {tuple(seq_lens.shape)}")
    out = torch.empty(B, Nh, kv_lora_rank)
    if not B:
        return out
    # a bad length or block id would read outside the pool: checked (CPU tensors, one reduction each)
    lo, hi = torch.aminmax(seq_lens)
    blo, bhi = torch.aminmax(block_table)
    lo, hi, blo, bhi = int(lo), int(hi), int(blo), int(bhi)   # SYNC: (CPU only) the bounds above
    num_blocks = kv_pool.shape[0] // block_size
    if lo < 1 or hi > max_len or -(-max_len // block_size) > block_table.shape[1] or blo < 0 or bhi >= num_blocks:
        raise ValueError(f"mla_decode: seq_lens in [{lo}, {hi}] (max_len {max_len}) need 1 .. {block_table.shape[1]} "
                         f"blocks of {block_size}, block ids in [{blo}, {bhi}] must be in [0, {num_blocks})")
    q, block_table, seq_lens = q.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    scratch = torch.empty(Nh * (max_len + 1))
    _lib_or_raise().wd_mla_decode(q.data_ptr(), B, Nh, D, kv_lora_rank, kv_pool.data_ptr(), block_table.data_ptr(),
                                  block_table.shape[1], seq_lens.data_ptr(), block_size, scale, out.data_ptr(),
                                  scratch.data_ptr())
    return out
