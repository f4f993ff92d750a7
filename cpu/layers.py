"""RMSNorm, rotary embedding and the absorbed MLA decode over the paged latent cache, in C (built by
cpu/build.py with cpu/gemm.py's source, whose vector helpers and streamed GEMM they use), each launcher
below the source it runs. They replace several torch ops per call (norms and rope: one pass instead of
six or ten) and read the latent cache through the block table instead of gathering it.

Legend: T tokens, Hh heads of a tensor, R rope dim, B decode sequences, Nh heads, D = C + R latent
width, C kv_lora_rank, S cache slots. Float32 CPU tensors, last dim contiguous.
  rmsnorm(x [..., N], weight [N], eps) -> [..., N]             = RMSNorm (attention_mla/norm.py)
  rope(x [T, (Hh,) R], cos, sin [T, R/2], interleave)          = RotaryEmbedding.apply (attention_mla/rope.py)
  mla_decode(q [B, Nh, D], kv_pool [S, D], ...) -> [B, Nh, C]  = paged_decode_reference (attention_mla/paged_decode.py)
      (or kv_pool an fp8 cache's packed rows, dequantised block by block, 16 values per vector op)
  route(x [T, H], weight [E, H], bias, cfg) -> ids, weights    = moe/gate.py Gate
The fused decoder layers built from these kernels: cpu/fused.py.
Tests: tests/cpu/.
"""
from __future__ import annotations

import ctypes

import torch

from .build import library, register
from .gemm import check_float32

SOURCE = r"""
/* y [M, N] = w * x * rsqrt(mean(x^2) + eps) per row (rows ldx / ldy apart) */
void wd_rmsnorm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t N,
                float eps) {
    int64_t N16 = N & ~(int64_t)15;
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        v16 acc = bc(0);
        for (int64_t n = 0; n < N16; n += 16) { v16 v = ld(xr + n); acc += v * v; }
        if (N16 < N) { v16 v = ld_part(xr + N16, N - N16); acc += v * v; }
        float ss = 0;
        for (int l = 0; l < 16; l++) ss += acc[l];
        v16 r = bc(1.0f / sqrtf(ss / N + eps));
        for (int64_t n = 0; n < N16; n += 16) st(yr + n, ld(w + n) * (ld(xr + n) * r));
        for (int64_t n = N16; n < N; n++) yr[n] = w[n] * (xr[n] * r[0]);
    }
}

/* Rotary embedding: x [T, Hh, R] (strides sxt, sxh; unit last) -> y [T, Hh, R] contiguous, cos/sin
   [T, R/2] contiguous. interleave: pairs (x[2i], x[2i+1]); else halves (x[i], x[i + R/2]). */
void wd_rope(const float *x, int64_t T, int64_t Hh, int64_t R, int64_t sxt, int64_t sxh, const float *cos,
             const float *sin, float *y, int interleave) {
    int64_t h2 = R / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * h2, *sn = sin + t * h2;
        for (int64_t h = 0; h < Hh; h++) {
            const float *xr = x + t * sxt + h * sxh;
            float *yr = y + (t * Hh + h) * R;
            for (int64_t i = 0; i < h2; i++) {
                int64_t a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + h2;
                float x1 = xr[a], x2 = xr[b];
                yr[a] = x1 * c[i] - x2 * sn[i];
                yr[b] = x2 * c[i] + x1 * sn[i];
            }
        }
    }
}

/* e4m3 bytes -> float: the byte's exponent and mantissa bits placed at the top of a float32's exponent
   and mantissa give the value times 2^-120 (e4m3 subnormals land on float32 subnormals, exactly), so
   one shift and one multiply by scale * 2^120 dequantise; 16 at a time. (0x7f / 0xff, e4m3's NaN, read
   as +-480: the quantiser never writes them.) */
#define FP8_ROWS 16   /* rows dequantised at a time: 16 x 576 floats stay in L1 */
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

/* Rows [first, first + n) of a packed fp8 pool (attention_mla/fp8_cache.py: W bytes a row, e4m3 c [C],
   float32 scales at soff, one per `group` values, fp32 k_pe [D - C] at roff) as floats kb [n, D]. */
static const float *fp8_rows(const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t group,
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
        memcpy(o + C, r + roff, (D - C) * sizeof(float));
    }
    return kb;
}

/* o[h, :16 NV] += sum over the nj rows j of p[h * L + j] * row_j[:16 NV], for NH heads (rows D apart,
   heads' scores L apart, outputs C apart): a tile of NH x NV accumulators stays in registers for the
   whole run of rows, each row's vectors loaded once for all NH heads. */
#define PV_TILE(NH, NV)                                                                            \
static inline void pv_##NH##_##NV(const float *rows, int64_t D, int64_t nj, const float *p, int64_t L, \
                                  float *o, int64_t C) {                                           \
    v16 acc[NH][NV];                                                                               \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) acc[h][v] = ld(o + h * C + 16 * v);  \
    for (int64_t j = 0; j < nj; j++) {                                                             \
        v16 r[NV];                                                                                 \
        for (int v = 0; v < NV; v++) r[v] = ld(rows + j * D + 16 * v);                             \
        for (int h = 0; h < NH; h++) {                                                             \
            v16 pv = bc(p[h * L + j]);                                                             \
            for (int v = 0; v < NV; v++) acc[h][v] += pv * r[v];                                   \
        }                                                                                          \
    }                                                                                              \
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) st(o + h * C + 16 * v, acc[h][v]);   \
}
PV_TILE(4, 4) PV_TILE(4, 1) PV_TILE(1, 4) PV_TILE(1, 1)

/* Absorbed MLA decode over the paged latent cache, one query token per sequence: scores = q . latent
   over the sequence's blocks (read through the block table, never gathered), fp32 softmax, out =
   p @ latent[:, :C]. scratch: Nh * (max_len + 1) floats. pool8 (else NULL): the cache is packed fp8
   rows instead of pool, and each block is dequantised into kb [bs, D] as it is read, once for the
   scores and once for the output. Returns 0, or -1 (nothing computed) when a
   length is outside 1 .. max_len or a block id it needs is outside the pool. */
int64_t wd_mla_decode(const float *q, int64_t B, int64_t Nh, int64_t D, int64_t C, const float *pool,
                      int64_t num_blocks, const int64_t *table, int64_t max_blocks, const int32_t *lens,
                      int64_t max_len, int64_t bs, float scale, float *out, float *scratch,
                      const uint8_t *pool8, int64_t W, int64_t soff, int64_t roff, int64_t group, float *kb) {
    int64_t C16 = C & ~(int64_t)15;
    for (int64_t b = 0; b < B; b++) {      /* nothing outside the pool or the scratch is ever read */
        if (lens[b] < 1 || lens[b] > max_len || (lens[b] - 1) / bs >= max_blocks) return -1;
        for (int64_t i = 0; i <= (lens[b] - 1) / bs; i++)
            if (table[b * max_blocks + i] < 0 || table[b * max_blocks + i] >= num_blocks) return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        int64_t L = lens[b];
        float *inv = scratch + Nh * L;
        const float *qb = q + b * Nh * D;
        float *ob = out + b * Nh * C, *sc = scratch;
        /* rows j0 .. j0 + n - 1 (never past their block): in place, or dequantised into kb (in L1) */
#define ROWS(j0, n) (pool8 ? fp8_rows(pool8, W, soff, roff, group, C, D, table[b * max_blocks + (j0) / bs] * bs \
                                      + (j0) % bs, n, kb) : pool + (table[b * max_blocks + (j0) / bs] * bs + (j0) % bs) * D)
#define CHUNK(j0) (L - (j0) < step - (j0) % step ? L - (j0) : step - (j0) % step)
        int64_t step = pool8 && bs > FP8_ROWS ? FP8_ROWS : bs;
        for (int64_t j0 = 0; j0 < L; j0 += CHUNK(j0)) linear(qb, D, ROWS(j0, CHUNK(j0)), D, sc + j0, L, Nh, CHUNK(j0), D);
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
        for (int64_t j0 = 0, nj; j0 < L; j0 += nj) {
            nj = CHUNK(j0);
            const float *blk = ROWS(j0, nj);
            for (int64_t c0 = 0, wide; c0 < C16; c0 += wide ? 64 : 16) {
                wide = C16 - c0 >= 64;
                for (int64_t n0 = 0, four; n0 < Nh; n0 += four ? 4 : 1) {
                    four = Nh - n0 >= 4;
                    const float *p = sc + n0 * L + j0;
                    float *o = ob + n0 * C + c0;
                    if (four && wide) pv_4_4(blk + c0, D, nj, p, L, o, C);
                    else if (four) pv_4_1(blk + c0, D, nj, p, L, o, C);
                    else if (wide) pv_1_4(blk + c0, D, nj, p, L, o, C);
                    else pv_1_1(blk + c0, D, nj, p, L, o, C);
                }
            }
            for (int64_t j = j0; j < j0 + nj; j++)
                for (int64_t n = 0; n < Nh; n++)
                    for (int64_t c = C16; c < C; c++) ob[n * C + c] += sc[n * L + j] * blk[(j - j0) * D + c];
        }
#undef ROWS
#undef CHUNK
        for (int64_t n = 0; n < Nh; n++)
            for (int64_t c = 0; c < C; c++) ob[n * C + c] *= inv[n];
    }
    return 0;
}

/* The router (moe/gate.py Gate), fused. logits [T, E] = x [T, H] @ w [E, H]^T (scratch); per token:
   scores (softmax or sigmoid), choice = scores + bias (when given); grouped methods keep the
   topk_group groups with the best group score (method 1: the group's max, 2: the sum of its top
   two) and hide the rest; the top k of choice (descending, the lower id first among equals) are
   the ids, their unbiased scores the weights (renormalised when norm, times scale). */
static int64_t best_of(const float *v, const unsigned char *taken, int64_t n) {
    int64_t b = -1;
    for (int64_t e = 0; e < n; e++)
        if (!taken[e] && (b < 0 || v[e] > v[b])) b = e;
    return b;
}

void wd_route(const float *x, int64_t T, int64_t H, const float *w, int64_t E, const float *bias,
              int sigmoid, int method, int64_t G, int64_t topk_group, int64_t k, int norm, float scale,
              float *logits, int64_t *ids, float *wts) {
    linear(x, H, w, H, logits, E, T, E, H);
    float choice[E], gscore[G > 0 ? G : 1];
    unsigned char taken[E], gtaken[G > 0 ? G : 1];
    int64_t per = G > 0 ? E / G : E;
    for (int64_t t = 0; t < T; t++) {
        float *sc = logits + t * E;
        if (sigmoid) {
            for (int64_t e = 0; e < E; e++) sc[e] = 1.0f / (1.0f + expf(-sc[e]));
        } else {
            float mx = sc[0], sum = 0;
            for (int64_t e = 1; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
            for (int64_t e = 0; e < E; e++) { sc[e] = expf(sc[e] - mx); sum += sc[e]; }
            for (int64_t e = 0; e < E; e++) sc[e] /= sum;
        }
        for (int64_t e = 0; e < E; e++) { choice[e] = bias ? sc[e] + bias[e] : sc[e]; taken[e] = 0; }
        if (method != 0 && G > 1) {
            for (int64_t g = 0; g < G; g++) {
                const float *c = choice + g * per;
                float a = c[0], b = -INFINITY;          /* the best and second best of the group */
                for (int64_t j = 1; j < per; j++) {
                    if (c[j] > a) { b = a; a = c[j]; } else if (c[j] > b) b = c[j];
                }
                gscore[g] = method == 2 ? a + b : a;
                gtaken[g] = 0;
            }
            for (int64_t i = 0; i < topk_group; i++) gtaken[best_of(gscore, gtaken, G)] = 1;
            for (int64_t g = 0; g < G; g++)
                if (!gtaken[g]) memset(taken + g * per, 1, per);   /* hidden: never chosen */
        }
        int64_t *id = ids + t * k;
        float *wt = wts + t * k, total = 0;
        for (int64_t i = 0; i < k; i++) {
            int64_t e = best_of(choice, taken, E);
            taken[e] = 1;
            id[i] = e;
            wt[i] = sc[e];
            total += sc[e];
        }
        float f = norm ? scale / (total + 1e-20f) : scale;
        for (int64_t i = 0; i < k; i++) wt[i] *= f;
    }
}

"""
P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {"wd_rmsnorm": ([P, I, P, P, I, I, I, F], None),
              "wd_rope": ([P, I, I, I, I, I, P, P, P, ctypes.c_int], None),
              "wd_mla_decode": ([P, I, I, I, I, P, I, P, I, P, I, I, F, P, P, P, I, I, I, I, P], I),
              "wd_route": ([P, I, I, P, I, P, ctypes.c_int, ctypes.c_int, I, I, I, ctypes.c_int, F, P, P, P], None)}
register(SOURCE, SIGNATURES)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * x * rsqrt(mean(x^2, -1) + eps) (attention_mla/norm.py RMSNorm)."""
    N = x.shape[-1]
    if not (x.dtype == weight.dtype == torch.float32 and not x.is_cuda and weight.shape == (N,)
            and weight.is_contiguous()):
        raise ValueError(f"rmsnorm: x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} {tuple(weight.shape)} must "
                         f"be float32 CPU tensors with weight [N={N}] contiguous")
    x2 = x.reshape(-1, N)
    if N and x2.shape[0] and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape)
    if out.numel():
        library().wd_rmsnorm(x2.data_ptr(), x2.stride(0), weight.data_ptr(), out.data_ptr(), N, x2.shape[0], N,
                             eps)
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, R] or [T, Hh, R], cos/sin [T, R/2] -> rotated x, contiguous (RotaryEmbedding.apply)."""
    T, R = x.shape[0], x.shape[-1]
    x3 = x[:, None] if x.dim() == 2 else x
    if not (x.dtype == cos.dtype == sin.dtype == torch.float32 and not x.is_cuda and x3.dim() == 3 and R % 2 == 0
            and tuple(cos.shape) == tuple(sin.shape) == (T, R // 2) and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope: x {x.dtype} {tuple(x.shape)} ([T, R] or [T, Hh, R], R even) and cos/sin "
                         f"{tuple(cos.shape)} (contiguous [T, R/2]) must be float32 CPU tensors")
    if x3.numel() and x3.stride(2) != 1:
        x3 = x3.contiguous()
    out = torch.empty(x.shape)
    if out.numel():
        library().wd_rope(x3.data_ptr(), T, x3.shape[1], R, x3.stride(0), x3.stride(1), cos.data_ptr(),
                          sin.data_ptr(), out.data_ptr(), int(interleave))
    return out


def mla_decode(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, kv_lora_rank: int, scale: float, max_len: int,
               fp8=None) -> torch.Tensor:
    """q [B, Nh, D] (absorbed: [q_nope W_UK, q_pe]), kv_pool [S, D], block_table [B, M] int64 block ids,
    seq_lens [B] int32 (each in 1 .. max_len; max_len a host int; AttnMeta.seq_tables gives all three)
    -> [B, Nh, C] (fp32 softmax). fp8: an fp8 cache's row layout (attention_mla/fp8_cache.py Fp8Latent,
    read by its fields only, so cpu/ needs nothing above it): kv_pool is then its packed uint8 rows
    [S, fp8.row_bytes] (RoPE part float32), read in place: 1 byte a latent value instead of 4."""
    check_float32("q", q, 3)
    B, Nh, D = q.shape
    if fp8 is None:
        check_float32("kv_pool", kv_pool, 2)
        width, args = D, (None, 0, 0, 0, 0, None)
    else:
        if kv_pool.dtype != torch.uint8 or kv_pool.dim() != 2 or kv_pool.shape[1] != fp8.row_bytes or kv_pool.is_cuda \
                or (fp8.kv_lora_rank, fp8.kv_lora_rank + fp8.rope_dim, fp8.rope_dtype) != (kv_lora_rank, D, torch.float32):
            raise ValueError(f"mla_decode: an fp8 pool must be uint8 [S, {fp8.row_bytes}] on CPU with a float32 RoPE "
                             f"part and kv_lora_rank + rope_dim = D ({D}), got {kv_pool.dtype} {tuple(kv_pool.shape)}, "
                             f"{fp8}")
        kb = torch.empty(min(block_size, 16) * D)   # FP8_ROWS rows
        width, args = fp8.row_bytes, (kv_pool.data_ptr(), fp8.row_bytes, fp8.scale_offset, fp8.rope_offset, fp8.group,
                                      kb.data_ptr())
    if kv_pool.shape[1] != width or not 0 < kv_lora_rank <= D or not kv_pool.is_contiguous():
        raise ValueError(f"mla_decode: q {tuple(q.shape)}, kv_pool {tuple(kv_pool.shape)} (contiguous) and "
                         f"kv_lora_rank {kv_lora_rank} do not fit")
    if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != B or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"mla_decode: block_table [B={B}, M] int64 and seq_lens [B] int32, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}, {seq_lens.dtype} {tuple(seq_lens.shape)}")
    q, block_table, seq_lens = q.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    out = torch.empty(B, Nh, kv_lora_rank)
    num_blocks, scratch = kv_pool.shape[0] // block_size, torch.empty(Nh * (max_len + 1))
    if B and library().wd_mla_decode(q.data_ptr(), B, Nh, D, kv_lora_rank, kv_pool.data_ptr(), num_blocks,
                                     block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(), max_len,
                                     block_size, scale, out.data_ptr(), scratch.data_ptr(), *args):
        raise _bad_tables("mla_decode", seq_lens, block_table, max_len, block_size, num_blocks)
    return out


def _bad_tables(who: str, seq_lens: torch.Tensor, block_table: torch.Tensor, max_len: int, block_size: int,
                num_blocks: int) -> ValueError:
    """The error for lengths or block ids the C decode refused (it checks them before reading anything)."""
    lo, hi = (int(v) for v in torch.aminmax(seq_lens))
    blo, bhi = (int(v) for v in torch.aminmax(block_table))
    return ValueError(f"{who}: seq_lens in [{lo}, {hi}] (max_len {max_len}) need 1 .. {block_table.shape[1]} "
                      f"blocks of {block_size}, block ids in [{blo}, {bhi}] must be in [0, {num_blocks})")


_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [E, H], bias [E] or None, cfg a moe.config.MoEConfig (read by its fields) ->
    topk_ids [T, k] int64, topk_weights [T, k] (moe/gate.py Gate.forward: one call instead of ~15 ops)."""
    check_float32("x", x, 2)
    check_float32("weight", weight, 2)
    (T, H), (E, H2) = x.shape, weight.shape
    k, G = cfg.top_k, cfg.n_group
    if H2 != H or not weight.is_contiguous() or E != cfg.n_routed_experts or not 1 <= k <= E or E % G:
        raise ValueError(f"route: x {tuple(x.shape)} and a contiguous weight {tuple(weight.shape)} with "
                         f"{cfg.n_routed_experts} experts, top-{k}, {G} groups do not fit")
    if bias is not None:
        check_float32("bias", bias, 1)
        if bias.shape[0] != E:
            raise ValueError(f"route: bias has {bias.shape[0]} entries, there are {E} experts")
    x = x if x.is_contiguous() else x.contiguous()
    ids, wts = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    if T:
        logits = torch.empty(T, E)
        library().wd_route(x.data_ptr(), T, H, weight.data_ptr(), E, None if bias is None else bias.data_ptr(),
                           int(cfg.scoring_func == "sigmoid"), _METHODS[cfg.topk_method], G, cfg.topk_group, k,
                           int(cfg.norm_topk_prob), cfg.routed_scaling_factor, logits.data_ptr(),
                           ids.data_ptr(), wts.data_ptr())
    return ids, wts
