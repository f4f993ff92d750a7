"""Streamed small-batch GEMM and the fused routed experts: the launchers of csrc/gemm.c and csrc/experts.c
(built by cpu/build.py), each checking shapes before it passes one struct to its kernel.

Why: a decode step multiplies every weight it uses by a handful of rows, so its speed is the speed at
which the weights stream from memory. On CPU, BLAS small-M GEMMs (MKL via F.linear / bmm) reach about
a third of a plain read's bandwidth (bench/decode_vs_hf.py measures both), and even reading two rows
of a matrix at once is slower than reading one after the other. These kernels read each weight row
once, front to back, doing all of the row's work while it is in L1.

Legend: M rows of activations (tokens, pairs, heads), N output features, K input features, T tokens,
H hidden, I moe_intermediate_size, El local experts, k top-k. CPU tensors, last dim contiguous; weights
float32 or bfloat16 (read as stored: bfloat16 by AVX512-BF16 dot products where the CPU has them, bf16_dot(),
else widened to float32 as they are loaded), activations float32 or bfloat16 (computed in float32), sums
float32.
  linear(x [M, K], w [N, K]) -> [M, N] float32            = F.linear(x, w)
  bmm_nt(x [B, M, K], w [B, N, K]) -> [B, M, N]           = x @ w.transpose(1, 2)
  experts(x, w13, w2, topk_ids, topk_weights) -> [T, H]   = Experts.forward_reference (moe/experts.py)
FP8 block-quantised weights (float8_e4m3fn + float32 block scales, moe/fp8.py; csrc/gemm_fp8.c), read as stored
and widened to float32 in registers, times their block's scale:
  linear_fp8(x [M, K], w [N, K], scale_inv, block) -> [M, N] float32 = F.linear(x, dequantize_fp8_block(w, ...))
  dequantize_fp8(w, scale_inv, block, dtype) -> [N, K]    = dequantize_fp8_block (for BLAS on big batches)
  experts(..., w13_scale=, w2_scale=, block=)             fp8 routed experts
FP4 weights (DeepSeek-V4's routed experts: e2m1 codes two a byte + an e8m0 scale byte per 32 values along K,
moe/fp4.py; csrc/gemm_fp4.c), read as stored and widened in registers; K a multiple of 32:
  linear_fp4(x [M, K], w [N, K/2] uint8, scale [N, K/32] uint8) -> [M, N] float32 = F.linear(x, dequantize_fp4(w, scale))
  dequantize_fp4(w, scale, dtype) -> [N, K]               = moe/fp4.py dequantize_fp4, in C
  experts(..., w13_scale=, w2_scale=) with uint8 weights   fp4 routed experts
experts(..., limit=) clamps the SwiGLU (DeepSeek-V4's swiglu_limit) as moe/experts.py Experts does.
Tests: tests/cpu/.
"""
from __future__ import annotations

import ctypes

import torch

from .build import fields, library, register

P, I = ctypes.c_void_p, ctypes.c_int64


WDT = {torch.float32: 0, torch.bfloat16: 1}   # the C kernels' weight / cache dtype codes (wideep.h WD_F32, WD_BF16)
WD_FP8 = 2                                     # wideep.h WD_FP8: e4m3 bytes + float32 block scales
WD_FP4 = 3                                     # wideep.h WD_FP4: e2m1 pairs + e8m0 scale bytes per 32
FP4_BLOCK = 32
FP8 = torch.float8_e4m3fn


def check_float32(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be a float32 CPU tensor with {dim} dims and a contiguous last dim, got "
                         f"{t.dtype} {t.device.type} shape {tuple(t.shape)} strides {t.stride()}")


def check_float(name: str, t: torch.Tensor, dim: int) -> None:
    """t is a float32 or bfloat16 CPU tensor with `dim` dims and a contiguous last dim."""
    if t.dtype not in WDT or t.device.type != "cpu" or t.dim() != dim or (t.numel() and t.stride(-1) != 1):
        raise ValueError(f"{name} must be a float32 or bfloat16 CPU tensor with {dim} dims and a contiguous last dim, "
                         f"got {t.dtype} {t.device.type} shape {tuple(t.shape)} strides {t.stride()}")


def as_f32(t: torch.Tensor) -> torch.Tensor:
    """Activations for the kernels: float32 (a bfloat16 tensor widened, exactly; strides kept)."""
    return t if t.dtype == torch.float32 else t.float()


class Bf16DotArgs(ctypes.Structure):
    """wd_bf16_dot_args (csrc/wideep.h)."""
    _fields_ = fields("want supported", I)


def bf16_dot(on: bool | None = None) -> bool:
    """Whether bfloat16 weights run on AVX512-BF16 dot products (activations rounded to bfloat16) rather than
    widened to float32 (activations exact). on: turn them on (where this CPU has them) or off; None: ask.
    On by default where the CPU has them; WIDEEP_CPU_BF16_DOT=0 in the environment starts with them off."""
    a = Bf16DotArgs(want=-1 if on is None else int(bool(on)))
    return bool(library().wd_bf16_dot(a))


def bf16_dot_supported() -> bool:
    """Whether this CPU has AVX512-BF16 (CPUID, at run time)."""
    a = Bf16DotArgs(want=-1)
    library().wd_bf16_dot(a)
    return bool(a.supported)


class AmxArgs(ctypes.Structure):
    """wd_amx_args (csrc/wideep.h)."""
    _fields_ = fields("want supported gemm_calls mla_calls fp8_parts", I)


_amx: bool | None = None   # the library's setting, as last set or asked (amx_on() reads it without a call)


def amx(on: bool | None = None) -> bool:
    """Whether bfloat16 weights of a few rows and more run on AMX tiles (csrc/gemm_amx.c; activations rounded to
    bfloat16, as the dot products round them, and only while the dot products are on). on: turn them on (where
    this CPU has them and the kernel lets this process use them) or off; None: ask. On by default where they
    can be; WIDEEP_CPU_AMX=0 in the environment starts with them off."""
    global _amx
    _amx = bool(library().wd_amx(AmxArgs(want=-1 if on is None else int(bool(on)))))
    return _amx


def amx_on() -> bool:
    """amx() without a call into the library once it has been asked (the launchers' per-call check)."""
    return _amx if _amx is not None else amx()


def amx_supported() -> bool:
    """Whether this CPU has AMX-BF16 tiles and the kernel lets this process use them (at run time)."""
    a = AmxArgs(want=-1)
    library().wd_amx(a)
    return bool(a.supported)


def amx_calls() -> dict[str, int]:
    """The calls that ran on the tiles since the library was loaded: {"gemm": GEMMs, "mla": paged decodes,
    "fp8_parts": the bfloat16 parts x was split into, summed over the FP8 GEMMs (1 each for bfloat16 activations)}."""
    a = AmxArgs(want=-1)
    library().wd_amx(a)
    return {"gemm": a.gemm_calls, "mla": a.mla_calls, "fp8_parts": a.fp8_parts}


class BmmNtArgs(ctypes.Structure):
    """wd_bmm_nt_args (csrc/wideep.h)."""
    _fields_ = fields("x w y", P) + fields("B sxb ldx swb ldw syb ldy M N K wdt xdt", I)


def _bmm_done(rc: int) -> None:
    if rc:
        raise MemoryError("bmm_nt / linear: no memory to widen the bfloat16 activations (csrc/gemm.c wd_bmm_nt)")


def bmm_nt(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, M, K], w [B, N, K] (any batch and row strides; float32 or bfloat16 each) -> [B, M, N] = x @ w^T,
    float32 (or out's dtype: a bfloat16 out gets the float32 result rounded)."""
    check_float("x", x, 3)
    check_float("w", w, 3)
    B, M, K = x.shape
    if w.shape[0] != B or w.shape[2] != K:
        raise ValueError(f"bmm_nt: x {tuple(x.shape)} and w {tuple(w.shape)} need the same batch and K")
    N = w.shape[1]
    out = torch.empty(B, M, N) if out is None else out
    check_float("out", out, 3)
    if tuple(out.shape) != (B, M, N):
        raise ValueError(f"bmm_nt: out is {tuple(out.shape)}, expected {(B, M, N)}")
    y = out if out.dtype == torch.float32 else torch.empty(B, M, N)
    if out.numel() and K:   # (bfloat16 x: read as is, csrc/gemm.c)
        _bmm_done(library().wd_bmm_nt(BmmNtArgs(x=x.data_ptr(), w=w.data_ptr(), y=y.data_ptr(), B=B, sxb=x.stride(0),
                                                 ldx=x.stride(1), swb=w.stride(0), ldw=w.stride(1), syb=y.stride(0),
                                                 ldy=y.stride(1), M=M, N=N, K=K, wdt=WDT[w.dtype], xdt=WDT[x.dtype])))
    elif out.numel():
        y.zero_()
    if y is not out:
        out.copy_(y)
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] (float32 or bfloat16 each) -> [M, N] float32 = F.linear(x, w) in float32 sums.
    Lean: decode calls it for every projection."""
    (M, K), (N, K2) = x.shape, w.shape
    if not (x.dtype in WDT and w.dtype in WDT and K == K2 and x.stride(1) == 1 and w.stride(1) == 1
            and not x.is_cuda and not w.is_cuda):
        check_float("x", x, 2)
        check_float("w", w, 2)
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} need the same K")
    out = torch.empty(M, N)
    if M and N and K:   # (bfloat16 x: read as is, csrc/gemm.c)
        _bmm_done(library().wd_bmm_nt(BmmNtArgs(x=x.data_ptr(), w=w.data_ptr(), y=out.data_ptr(), B=1,
                                                 ldx=x.stride(0), ldw=w.stride(0), ldy=N, M=M, N=N, K=K,
                                                 wdt=WDT[w.dtype], xdt=WDT[x.dtype])))
    elif M and N:
        out.zero_()
    return out


class LinearFp8Args(ctypes.Structure):
    """wd_linear_fp8_args (csrc/wideep.h)."""
    _fields_ = fields("x w s y", P) + fields("M N K ldx ldw lds ldy br bk odt", I)


def check_fp8(name: str, w: torch.Tensor, scale: torch.Tensor, block) -> tuple[int, int]:
    """w [..., N, K] float8_e4m3fn and scale [..., ceil(N/br), ceil(K/bk)] float32, contiguous CPU tensors, in a
    block (br, bk) the kernels take (bk a multiple of 16) -> (br, bk); ValueError naming what does not fit."""
    if len(tuple(block)) != 2 or min(block) < 1:
        raise ValueError(f"{name}: block must be two positive ints, got {block}")
    br, bk = int(block[0]), int(block[1])
    if bk % 16:
        raise ValueError(f"{name}: the fp8 kernels need the block along K to be a multiple of 16, got block {[br, bk]}")
    if w.dtype != FP8 or w.device.type != "cpu" or w.dim() < 2 or not w.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float8_e4m3fn CPU tensor, got {w.dtype} {w.device.type} "
                         f"shape {tuple(w.shape)}")
    want = (*w.shape[:-2], -(-w.shape[-2] // br), -(-w.shape[-1] // bk))
    if (scale.dtype != torch.float32 or scale.device.type != "cpu" or not scale.is_contiguous()
            or tuple(scale.shape) != want):
        raise ValueError(f"{name}'s scales must be a contiguous float32 CPU tensor of shape {want} for weight "
                         f"{tuple(w.shape)} in {br}x{bk} blocks, got {scale.dtype} {tuple(scale.shape)}")
    return br, bk


def linear_fp8(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, last dim contiguous), w [N, K] float8_e4m3fn, scale_inv [ceil(N/br),
    ceil(K/bk)] float32 -> [M, N] float32 = x @ dequantize_fp8_block(w, scale_inv, block)^T, the weights read
    as stored (one byte each)."""
    check_float("x", x, 2)
    br, bk = check_fp8("linear_fp8: w", w, scale_inv, block)
    (M, K), (N, K2) = x.shape, w.shape
    if K != K2:
        raise ValueError(f"linear_fp8: x {tuple(x.shape)} and w {tuple(w.shape)} need the same K")
    x = as_f32(x)
    out = torch.empty(M, N)
    if M and N and K:
        library().wd_linear_fp8(LinearFp8Args(x=x.data_ptr(), w=w.data_ptr(), s=scale_inv.data_ptr(),
                                              y=out.data_ptr(), M=M, N=N, K=K, ldx=x.stride(0), ldw=K,
                                              lds=scale_inv.shape[1], ldy=N, br=br, bk=bk))
    elif M and N:
        out.zero_()
    return out


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [N, K] float8_e4m3fn + scale_inv -> [N, K] in dtype (float32 or bfloat16) = moe/fp8.py's
    dequantize_fp8_block, in one pass of C (the big-batch GEMMs run on BLAS over this copy)."""
    br, bk = check_fp8("dequantize_fp8: w", w, scale_inv, block)
    if dtype not in WDT or w.dim() != 2:
        raise ValueError(f"dequantize_fp8: a 2-D weight to float32 or bfloat16, got shape {tuple(w.shape)} to {dtype}")
    N, K = w.shape
    out = torch.empty(N, K, dtype=dtype)
    if N and K:
        library().wd_linear_fp8(LinearFp8Args(x=None, w=w.data_ptr(), s=scale_inv.data_ptr(), y=out.data_ptr(),
                                              N=N, K=K, ldw=K, lds=scale_inv.shape[1], ldy=K, br=br, bk=bk,
                                              odt=WDT[dtype]))
    return out


class LinearFp4Args(ctypes.Structure):
    """wd_linear_fp4_args (csrc/wideep.h)."""
    _fields_ = fields("x w s y xp", P) + fields("M N K ldx ldw lds ldy odt", I)


def fp4_xp(M: int, K: int) -> int:
    """Floats of scratch linear_fp4 permutes x into (wideep.h FP4_XP)."""
    return M * -(-K // 128) * 128


def check_fp4(name: str, w: torch.Tensor, scale: torch.Tensor) -> int:
    """w [..., N, K/2] uint8 (e2m1 pairs) and scale [..., N, K/32] uint8 (e8m0 bytes), contiguous CPU tensors,
    K a multiple of 32 -> K; ValueError naming what does not fit."""
    if w.dtype != torch.uint8 or w.device.type != "cpu" or w.dim() < 2 or not w.is_contiguous():
        raise ValueError(f"{name} must be a contiguous uint8 CPU tensor of e2m1 pairs, got {w.dtype} {w.device.type} "
                         f"shape {tuple(w.shape)}")
    K = 2 * w.shape[-1]
    if K % FP4_BLOCK:
        raise ValueError(f"{name}: the fp4 kernels need K (2 x {w.shape[-1]} = {K}) to be a multiple of {FP4_BLOCK}, "
                         f"one e8m0 scale per {FP4_BLOCK} values")
    want = (*w.shape[:-1], K // FP4_BLOCK)
    if (scale.dtype != torch.uint8 or scale.device.type != "cpu" or not scale.is_contiguous()
            or tuple(scale.shape) != want):
        raise ValueError(f"{name}'s scales must be a contiguous uint8 (e8m0) CPU tensor of shape {want} for weight "
                         f"{tuple(w.shape)} (K = {K}), got {scale.dtype} {tuple(scale.shape)}")
    return K


def linear_fp4(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, last dim contiguous), w [N, K/2] uint8, scale [N, K/32] uint8 -> [M, N]
    float32 = x @ moe.fp4.dequantize_fp4(w, scale)^T, the weights read as stored (half a byte each)."""
    check_float("x", x, 2)
    K = check_fp4("linear_fp4: w", w, scale)
    M, N = x.shape[0], w.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"linear_fp4: x {tuple(x.shape)} and w {tuple(w.shape)} (K = {K}) need the same K")
    x = as_f32(x)
    out = torch.empty(M, N)
    if M and N and K:
        xp = torch.empty(fp4_xp(M, K))
        library().wd_linear_fp4(LinearFp4Args(x=x.data_ptr(), w=w.data_ptr(), s=scale.data_ptr(), y=out.data_ptr(),
                                              xp=xp.data_ptr(), M=M, N=N, K=K, ldx=x.stride(0), ldw=K // 2,
                                              lds=K // FP4_BLOCK, ldy=N))
    elif M and N:
        out.zero_()
    return out


def dequantize_fp4(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [N, K/2] uint8 + scale [N, K/32] uint8 -> [N, K] in dtype (float32 or bfloat16) = moe/fp4.py's
    dequantize_fp4, in one pass of C (the big-batch GEMMs run on BLAS over this copy)."""
    K = check_fp4("dequantize_fp4: w", w, scale)
    if dtype not in WDT or w.dim() != 2:
        raise ValueError(f"dequantize_fp4: a 2-D weight to float32 or bfloat16, got shape {tuple(w.shape)} to {dtype}")
    N = w.shape[0]
    out = torch.empty(N, K, dtype=dtype)
    if N and K:
        library().wd_linear_fp4(LinearFp4Args(x=None, w=w.data_ptr(), s=scale.data_ptr(), y=out.data_ptr(), N=N, K=K,
                                              ldw=K // 2, lds=K // FP4_BLOCK, ldy=K, odt=WDT[dtype]))
    return out


class ExpertsArgs(ctypes.Structure):
    """wd_experts_args (csrc/wideep.h)."""
    _fields_ = (fields("x w13 w2 wts ids out scratch iscratch s13 s2", P)
                + fields("T H I El k wdt br bk xdt", I) + [("limit", ctypes.c_float)])


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
            block=None, limit: float | None = None) -> torch.Tensor:
    """x [T, H], w13 [El, 2I, H], w2 [El, H, I] (contiguous, one dtype: float32 or bfloat16, or float8_e4m3fn
    with w13_scale [El, 2 ceil(I/br), ceil(H/bk)] (gate's scale rows, then up's) and w2_scale [El, ceil(H/br),
    ceil(I/bk)] in `block` (br, bk): moe/fp8.py quantize_experts_fp8; or fp4: uint8 w13 [El, 2I, H/2], w2 [El,
    H, I/2] of e2m1 pairs with uint8 e8m0 w13_scale [El, 2I, H/32], w2_scale [El, H, I/32], H and I multiples
    of 32), topk_ids [T, k] local ids (-1: elsewhere), topk_weights [T, k] -> [T, H] in x's dtype (float32
    sums): only the experts that have tokens are read. limit: the clamped SwiGLU (gate <= limit, |up| <=
    limit), None: plain. No host sync."""
    check_float("x", x, 2)
    fp8, fp4 = w13.dtype == FP8, w13.dtype == torch.uint8
    if limit is not None and not limit > 0:
        raise ValueError(f"experts: limit must be > 0 (or None), got {limit}")
    if fp4:
        if w13_scale is None or w2_scale is None or block is not None:
            raise ValueError("experts: uint8 (fp4) weights need w13_scale and w2_scale (e8m0 bytes) and no block")
        check_fp4("experts: w13", w13, w13_scale)
        check_fp4("experts: w2", w2, w2_scale)
        El, I2, Hh = w13.shape
        if x.shape[1] != 2 * Hh or w2.dtype != torch.uint8 or tuple(w2.shape) != (El, 2 * Hh, I2 // 4):
            raise ValueError(f"experts: x {tuple(x.shape)}, fp4 w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} must "
                             f"be [T, H], [El, 2I, H/2], [El, H, I/2] uint8")
        br = bk = 0
    elif fp8:
        if w13_scale is None or w2_scale is None or block is None:
            raise ValueError("experts: float8_e4m3fn weights need w13_scale, w2_scale and block")
        br, bk = check_fp8("experts: w2", w2, w2_scale, block)
        El_, I2_, H_ = w13.shape
        half = -(-(I2_ // 2) // br)
        want = (El_, 2 * half, -(-H_ // bk))
        if tuple(w13_scale.shape) != want:
            raise ValueError(f"experts: w13_scale is {tuple(w13_scale.shape)}, expected {want} (gate's and up's "
                             f"scale rows) for w13 {tuple(w13.shape)} in {br}x{bk} blocks")
        if (w13.device.type != "cpu" or not w13.is_contiguous() or w13_scale.dtype != torch.float32
                or not w13_scale.is_contiguous()):
            raise ValueError("experts: w13 and w13_scale must be contiguous float8_e4m3fn and float32 CPU tensors")
    else:
        if w13_scale is not None or w2_scale is not None:
            raise ValueError(f"experts: scales are for float8_e4m3fn weights, w13 is {w13.dtype}")
        check_float("w13", w13, 3)
        check_float("w2", w2, 3)
        br = bk = 0
    T, H = x.shape
    El, I2, H2 = w13.shape
    H2 = 2 * H2 if fp4 else H2
    w2_shape = (El, H, I2 // 4) if fp4 else (El, H, I2 // 2)
    if H2 != H or tuple(w2.shape) != w2_shape or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} must be "
                         f"[T, H], [El, 2I, H], [El, H, I], weights contiguous")
    if w13.dtype != w2.dtype:
        raise ValueError(f"experts: w13 is {w13.dtype}, w2 {w2.dtype}: the kernel takes one weight dtype")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"experts: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={T}, k]")
    if topk_ids.dtype != torch.int64:
        raise ValueError(f"experts: topk_ids must be int64, got {topk_ids.dtype}")
    dtype = x.dtype
    x, ids, wts = x.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous()   # (bfloat16 x: read as is)
    I, k = I2 // 2, ids.shape[1]
    out = torch.zeros(T, H)
    if T and k:
        iscratch = torch.empty(2 * (El + 1) + T * k, dtype=torch.int64)
        scratch = torch.empty(T * (2 * H + 3 * I) + (fp4_xp(T * k, max(H, I)) if fp4 else 0))
        rc = library().wd_experts(ExpertsArgs(x=x.data_ptr(), w13=w13.data_ptr(), w2=w2.data_ptr(), wts=wts.data_ptr(),
                                              ids=ids.data_ptr(), out=out.data_ptr(), scratch=scratch.data_ptr(),
                                              iscratch=iscratch.data_ptr(), T=T, H=H, I=I, El=El, k=k,
                                              wdt=WD_FP8 if fp8 else WD_FP4 if fp4 else WDT[w13.dtype],
                                              s13=w13_scale.data_ptr() if fp8 or fp4 else None,
                                              s2=w2_scale.data_ptr() if fp8 or fp4 else None, br=br, bk=bk,
                                              xdt=WDT[x.dtype], limit=limit or 0.0))
        if rc < 0:   # an id past the last local expert: the kernel would have read past the weights
            raise ValueError(f"experts: topk_ids holds local id {int(ids.view(-1)[-1 - rc])}, there are {El} "
                             f"local experts")
    return out.to(dtype)


register({"wd_bmm_nt": (BmmNtArgs, I), "wd_experts": (ExpertsArgs, I), "wd_bf16_dot": (Bf16DotArgs, I),
          "wd_amx": (AmxArgs, I),
          "wd_linear_fp8": (LinearFp8Args, I), "wd_linear_fp4": (LinearFp4Args, I)})
