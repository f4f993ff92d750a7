"""RMSNorm, rotary embedding, the absorbed MLA decode over the paged latent cache and the router: the
launchers of csrc/norm_rope.c, mla_decode.c and route.c (built by cpu/build.py), each checking shapes
before it passes one struct to its kernel. They replace several torch ops per call (norms and rope: one pass instead of
six or ten) and read the latent cache through the block table instead of gathering it.

Legend: T tokens, Hh heads of a tensor, R rope dim, B decode sequences, Nh heads, D = C + R latent
width, C kv_lora_rank, S cache slots. CPU tensors, last dim contiguous, float32 or bfloat16: activations are
computed in float32 and returned in their own dtype, weights and a latent cache are read as stored.
  rmsnorm(x [..., N], weight [N], eps) -> [..., N]             = RMSNorm (layers/norm.py)
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

from .tune import compare, register as register_tuned, limit as tuned_limit
from .build import fields, library, register
from .gemm import WDT, as_f32, check_float, check_float32

P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class RmsnormArgs(ctypes.Structure):
    """wd_rmsnorm_args (csrc/wideep.h)."""
    _fields_ = fields("x w y", P) + fields("ldx ldy M N wdt xdt ydt", I) + [("eps", F)]


def _done(who: str, rc: int) -> None:
    if rc:
        raise MemoryError(f"{who}: no memory for a row's float32 copy (csrc/norm_rope.c)")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * x * rsqrt(mean(x^2, -1) + eps) (layers/norm.py RMSNorm), in float32,
    returned in the dtype RMSNorm's would have (x's, promoted with weight's)."""
    N = x.shape[-1]
    if not (x.dtype in WDT and weight.dtype in WDT and not x.is_cuda and weight.shape == (N,)
            and weight.is_contiguous()):
        raise ValueError(f"rmsnorm: x {x.dtype} {tuple(x.shape)} and weight {weight.dtype} {tuple(weight.shape)} must "
                         f"be float32 or bfloat16 CPU tensors with weight [N={N}] contiguous")
    dtype = torch.promote_types(x.dtype, weight.dtype)
    x2 = x.reshape(-1, N)   # (bfloat16 in or out: converted a row at a time in C)
    if N and x2.shape[0] and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=dtype)
    if out.numel():
        _done("rmsnorm", library().wd_rmsnorm(RmsnormArgs(
            x=x2.data_ptr(), w=weight.data_ptr(), y=out.data_ptr(), ldx=x2.stride(0), ldy=N, M=x2.shape[0], N=N,
            eps=eps, wdt=WDT[weight.dtype], xdt=WDT[x.dtype], ydt=WDT[dtype])))
    return out.view(x.shape)


class RopeArgs(ctypes.Structure):
    """wd_rope_args (csrc/wideep.h)."""
    _fields_ = fields("x cos sin y", P) + fields("T Hh R sxt sxh interleave xdt ydt", I)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, R] or [T, Hh, R], cos/sin [T, R/2] -> rotated x, contiguous (RotaryEmbedding.apply)."""
    T, R = x.shape[0], x.shape[-1]
    x3 = x[:, None] if x.dim() == 2 else x
    if not (x.dtype in WDT and cos.dtype == sin.dtype == torch.float32 and not x.is_cuda and x3.dim() == 3
            and R % 2 == 0 and tuple(cos.shape) == tuple(sin.shape) == (T, R // 2) and cos.is_contiguous()
            and sin.is_contiguous()):
        raise ValueError(f"rope: x {x.dtype} {tuple(x.shape)} ([T, R] or [T, Hh, R], R even; float32 or bfloat16) "
                         f"and cos/sin {cos.dtype} {tuple(cos.shape)} (contiguous float32 [T, R/2]) must be CPU tensors")
    if x3.numel() and x3.stride(2) != 1:
        x3 = x3.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)   # (bfloat16 in and out: converted a token at a time in C)
    if out.numel():
        _done("rope", library().wd_rope(RopeArgs(
            x=x3.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), y=out.data_ptr(), T=T, Hh=x3.shape[1], R=R,
            sxt=x3.stride(0), sxh=x3.stride(1), interleave=int(interleave), xdt=WDT[x.dtype], ydt=WDT[x.dtype])))
    return out


class MlaDecodeArgs(ctypes.Structure):
    """wd_mla_decode_args (csrc/wideep.h)."""
    _fields_ = (fields("q pool table lens out scratch pool8 kb", P)
                + fields("B Nh D C num_blocks max_blocks max_len bs W soff roff group pdt fp4 toff", I) + [("scale", F)])


def mla_decode(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, kv_lora_rank: int, scale: float, max_len: int,
               fp8=None) -> torch.Tensor:
    """q [B, Nh, D] (absorbed: [q_nope W_UK, q_pe]), kv_pool [S, D] float32 or bfloat16, block_table [B, M]
    int64 block ids, seq_lens [B] int32 (each in 1 .. max_len; max_len a host int; AttnMeta.seq_tables gives
    all three) -> [B, Nh, C] float32 (fp32 softmax). fp8: an fp8 cache's row layout (attention_mla/fp8_cache.py
    Fp8Latent, read by its fields only, so cpu/ needs nothing above it): kv_pool is then its packed uint8 rows
    [S, fp8.row_bytes] (RoPE part float32 or bfloat16), read in place: 1 byte a latent value instead of 4. An fp4
    cache's layout (attention_mla/fp4_cache.py Fp4Latent, name "fp4_e2m1": e2m1 codes two a byte, an e4m3 scale per
    16 values, a float32 one per token) likewise: half a byte a latent value."""
    check_float("q", q, 3)
    q = as_f32(q)
    B, Nh, D = q.shape
    if fp8 is None:
        check_float("kv_pool", kv_pool, 2)
        width, fp8_args = D, dict(pdt=WDT[kv_pool.dtype])
    else:
        fp4 = fp8.name == "fp4_e2m1"
        kind = "fp4" if fp4 else "fp8"
        if fp4 and (fp8.group != 16 or kv_lora_rank % 16):
            raise ValueError(f"mla_decode: an fp4 pool needs one scale per 16 values and kv_lora_rank a multiple of "
                             f"16, got group {fp8.group}, kv_lora_rank {kv_lora_rank}")
        if kv_pool.dtype != torch.uint8 or kv_pool.dim() != 2 or kv_pool.shape[1] != fp8.row_bytes or kv_pool.is_cuda \
                or (fp8.kv_lora_rank, fp8.kv_lora_rank + fp8.rope_dim) != (kv_lora_rank, D) or fp8.rope_dtype not in WDT:
            raise ValueError(f"mla_decode: an {kind} pool must be uint8 [S, {fp8.row_bytes}] on CPU with a float32 or "
                             f"bfloat16 RoPE part and kv_lora_rank + rope_dim = D ({D}), got {kv_pool.dtype} "
                             f"{tuple(kv_pool.shape)}, {fp8}")
        kb = torch.empty(min(block_size, 16) * D)   # FP8_ROWS rows
        width, fp8_args = fp8.row_bytes, dict(pool8=kv_pool.data_ptr(), W=fp8.row_bytes, soff=fp8.scale_offset,
                                              roff=fp8.rope_offset, group=fp8.group, kb=kb.data_ptr(),
                                              pdt=WDT[fp8.rope_dtype], fp4=int(fp4),
                                              toff=fp8.token_offset if fp4 else 0)
    if kv_pool.shape[1] != width or not 0 < kv_lora_rank <= D or not kv_pool.is_contiguous():
        raise ValueError(f"mla_decode: q {tuple(q.shape)}, kv_pool {tuple(kv_pool.shape)} (contiguous) and "
                         f"kv_lora_rank {kv_lora_rank} do not fit")
    if block_table.dtype != torch.int64 or seq_lens.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != B or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"mla_decode: block_table [B={B}, M] int64 and seq_lens [B] int32, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}, {seq_lens.dtype} {tuple(seq_lens.shape)}")
    q, block_table, seq_lens = q.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    if fp8 is None and B and not tuned_limit("mla_decode"):   # this machine measured torch's faster (cpu/tune.py)
        return mla_decode_torch(q, kv_pool, block_table, seq_lens, block_size, kv_lora_rank, scale, max_len)
    out = torch.empty(B, Nh, kv_lora_rank)
    num_blocks, scratch = kv_pool.shape[0] // block_size, torch.empty(Nh * (max_len + 1))
    if B and library().wd_mla_decode(MlaDecodeArgs(
            q=q.data_ptr(), pool=kv_pool.data_ptr(), table=block_table.data_ptr(),
            lens=seq_lens.data_ptr(), out=out.data_ptr(), scratch=scratch.data_ptr(), B=B, Nh=Nh, D=D, C=kv_lora_rank,
            num_blocks=num_blocks, max_blocks=block_table.shape[1], max_len=max_len, bs=block_size, scale=scale,
            **fp8_args)):
        raise _bad_tables("mla_decode", seq_lens, block_table, max_len, block_size, num_blocks)
    return out


def mla_decode_torch(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     block_size: int, kv_lora_rank: int, scale: float, max_len: int) -> torch.Tensor:
    """mla_decode's result by torch's operations (a float32 or bfloat16 pool): each sequence's first max_len rows
    gathered through its blocks, one batched product, a masked float32 softmax, one batched product."""
    B, S = q.shape[0], kv_pool.shape[0]
    nblk = -(-max_len // block_size)
    pos = torch.arange(nblk * block_size)[:max_len]
    slots = (block_table[:, pos // block_size] * block_size + pos % block_size).clamp_(0, S - 1)   # [B, L]
    ctx = kv_pool[slots].float()                                                                  # [B, L, D]
    scores = torch.bmm(q, ctx.transpose(1, 2)) * scale                                            # [B, Nh, L]
    scores.masked_fill_((pos[None, :] >= seq_lens[:, None].long())[:, None, :], float("-inf"))
    return torch.bmm(scores.softmax(-1), ctx[..., :kv_lora_rank])


def _measure_mla_decode(cap: int, B: int = 8, heads: int = 16, C: int = 512, R: int = 64, L: int = 512,
                        bs: int = 64):
    """tune's measure(cap): the C paged decode against mla_decode_torch, B sequences of L tokens, DeepSeek-V3's
    latent widths -> (1: C, or 0: torch; {"B8": C time / torch time})."""
    g = torch.Generator().manual_seed(2)
    D, nblk = C + R, -(-L // bs)
    pool = torch.randn(B * nblk * bs, D, generator=g)
    table = torch.arange(B * nblk, dtype=torch.int64).view(B, nblk)
    lens = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, heads, D, generator=g)
    r = compare(lambda: mla_decode(q, pool, table, lens, bs, C, D ** -0.5, L),
                     lambda: mla_decode_torch(q, pool, table, lens, bs, C, D ** -0.5, L))
    return (1 if r <= 1.0 and cap else 0), {f"B{B}": round(r, 3)}


register_tuned("mla_decode", lambda: 1, _measure_mla_decode)


def _bad_tables(who: str, seq_lens: torch.Tensor, block_table: torch.Tensor, max_len: int, block_size: int,
                num_blocks: int) -> ValueError:
    """The error for lengths or block ids the C decode refused (it checks them before reading anything)."""
    lo, hi = (int(v) for v in torch.aminmax(seq_lens))
    blo, bhi = (int(v) for v in torch.aminmax(block_table))
    return ValueError(f"{who}: seq_lens in [{lo}, {hi}] (max_len {max_len}) need 1 .. {block_table.shape[1]} "
                      f"blocks of {block_size}, block ids in [{blo}, {bhi}] must be in [0, {num_blocks})")


class RouteArgs(ctypes.Structure):
    """wd_route_args (csrc/wideep.h)."""
    _fields_ = (fields("x w bias logits wts ids", P) + fields("T H E G topk_group k sigmoid method norm", I)
                + [("scale", F)])


ROUTE_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}   # the C router's codes of a topk_method


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (float32 or bfloat16), weight [E, H] float32, bias [E] float32 or None, cfg a moe.config.MoEConfig
    (read by its fields) ->
    topk_ids [T, k] int64, topk_weights [T, k] (moe/gate.py Gate.forward: one call instead of ~15 ops)."""
    check_float("x", x, 2)
    check_float32("weight", weight, 2)
    x = as_f32(x)
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
        library().wd_route(RouteArgs(
            x=x.data_ptr(), w=weight.data_ptr(), bias=None if bias is None else bias.data_ptr(),
            logits=logits.data_ptr(), wts=wts.data_ptr(), ids=ids.data_ptr(), T=T, H=H, E=E, G=G,
            topk_group=cfg.topk_group, k=k, sigmoid=int(cfg.scoring_func == "sigmoid"),
            method=ROUTE_METHODS[cfg.topk_method], norm=int(cfg.norm_topk_prob), scale=cfg.routed_scaling_factor))
    return ids, wts


class HcEnterArgs(ctypes.Structure):
    """wd_hc_enter_args (csrc/wideep.h)."""
    _fields_ = fields("x fn base scale pre post comb y", P) + fields("T n H iters head xdt ydt", I) + fields("eps norm_eps", F)


class HcLeaveArgs(ctypes.Structure):
    """wd_hc_leave_args (csrc/wideep.h)."""
    _fields_ = fields("x out post comb y", P) + fields("T n H xdt odt", I)


def _hc_streams(who: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3 or x.dtype not in WDT or x.is_cuda:
        raise ValueError(f"{who}: streams must be a float32 or bfloat16 CPU tensor [T, n, H], got {x.dtype} "
                         f"{tuple(x.shape)}")
    return x if x.is_contiguous() else x.contiguous()


def hc_enter(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
             norm_eps: float, head: bool = False):
    """A hyper-connection's entry (layers/hyper_connection.py: HyperConnection.weights then collapse; head: HyperHead,
    pre only): streams x [T, n, H] -> (y [T, H] in x's dtype, pre [T, n], post [T, n], comb [T, n, n]; post and comb
    None for the head), float32 inside."""
    x = _hc_streams("hc_enter", x)
    T, n, H = x.shape
    J = n if head else (2 + n) * n
    for name, t, shape in (("fn", fn, (J, n * H)), ("base", base, (J,)), ("scale", scale, (1 if head else 3,))):
        check_float32(name, t, len(shape))
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"hc_enter: {name} must be contiguous {list(shape)}, got {tuple(t.shape)}")
    y, pre = torch.empty(T, H, dtype=x.dtype), torch.empty(T, n)
    post, comb = (None, None) if head else (torch.empty(T, n), torch.empty(T, n, n))
    if T:
        _done("hc_enter", library().wd_hc_enter(HcEnterArgs(
            x=x.data_ptr(), fn=fn.data_ptr(), base=base.data_ptr(), scale=scale.data_ptr(), pre=pre.data_ptr(),
            post=None if head else post.data_ptr(), comb=None if head else comb.data_ptr(), y=y.data_ptr(), T=T, n=n,
            H=H, iters=iters, head=int(head), xdt=WDT[x.dtype], ydt=WDT[x.dtype], eps=eps, norm_eps=norm_eps)))
    return y, pre, post, comb


def hc_leave(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A hyper-connection's exit: streams x [T, n, H], the block's out [T, H], post [T, n], comb [T, n, n] (float32)
    -> the next streams [T, n, H] in x's dtype = post * out + comb^T x (HyperConnection.expand), float32 inside."""
    x = _hc_streams("hc_leave", x)
    T, n, H = x.shape
    if out.shape != (T, H) or out.dtype not in WDT:
        raise ValueError(f"hc_leave: out must be float32 or bfloat16 [{T}, {H}], got {out.dtype} {tuple(out.shape)}")
    out = out if out.is_contiguous() else out.contiguous()
    for name, t, shape in (("post", post, (T, n)), ("comb", comb, (T, n, n))):
        check_float32(name, t, len(shape))
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"hc_leave: {name} must be contiguous {list(shape)}, got {tuple(t.shape)}")
    y = torch.empty_like(x)
    if T:
        _done("hc_leave", library().wd_hc_leave(HcLeaveArgs(
            x=x.data_ptr(), out=out.data_ptr(), post=post.data_ptr(), comb=comb.data_ptr(), y=y.data_ptr(), T=T, n=n,
            H=H, xdt=WDT[x.dtype], odt=WDT[out.dtype])))
    return y


register({"wd_rmsnorm": (RmsnormArgs, I), "wd_rope": (RopeArgs, I), "wd_mla_decode": (MlaDecodeArgs, I),
          "wd_route": (RouteArgs, None), "wd_hc_enter": (HcEnterArgs, I), "wd_hc_leave": (HcLeaveArgs, I)})
