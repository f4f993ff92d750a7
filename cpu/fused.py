"""A decoder layer's halves, a decode step's whole stack of layers and an MTP layer's draft passes, each as one C
call: the launchers of csrc/fused.c (built by cpu/build.py; it calls the other files' kernels), each passing one
struct, beside the ctypes twins of csrc/wideep.h's structs. They take tensors, pointers and those structs, never a
model's modules: the model's fused decode (engine/model/fused_decode.py) decides when they run and builds the
per-layer structs from its modules (engine/model/fused_weights.py). What they replace: the dozens of small torch
ops and Python calls between a layer's kernels, which inside a decode step cost ~10x what they cost alone (every
layer's weight stream empties the caches the interpreter runs from). They make exactly the kernel calls of the
operation-by-operation path, in its order (docs/kernels.md).

Legend: T tokens (each the only query of its sequence on decode steps), H hidden, E experts, k top-k,
I moe_intermediate_size, Is a SwiGLU's intermediate size. CPU tensors, contiguous; a layer's weights all
float32 or all bfloat16 (the router's float32 either way: moe/gate.py), or an fp8 checkpoint's projections and
routed experts kept as stored (e4m3 + block scales: Fp8Mat; the norms and kv_b_proj in the model dtype), the
latent cache float32 or bfloat16,
activations float32 inside (a bfloat16 x in gives bfloat16 outputs, rounded once at the end). A layer's
weights go to C as a struct made once (MlaWeights, MoeWeights, MlpWeights; Fp8Mat for an fp8 projection), kept by
the caller with the tensors it points into; scratch is this thread's, shared by all calls (scratch()).
  mla_layer(x, MlaWeights, w_uk_t, cos, sin, pool, ...) -> h, mlp_in   the attention half (decode plan)
  moe_layer(h, x, MoeWeights, load) -> out, ids, wts     the MoE half on one EP rank (decode plan)
  mlp_layer(h, x, MlpWeights) -> out                     a dense layer's MLP half, h + MLP(x) (decode plan)
  decode_stack(x, layers, ...) -> out, ids, wts          every layer of a decode step (decode plan)
  mtp_pass(layer, ..., prev, ...) -> out, tokens         an MTP layer's draft passes: input, layer, head, argmax
Tests: tests/cpu/test_fused.py (each call against torch, structs from raw tensors), test_cpu_e2e.py (in an engine);
the structs built from a model's modules and the plan: tests/engine/test_fused_weights.py, test_fused_decode.py.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .build import fields, library, register
from .gemm import WDT, as_f32
from .layers import _bad_tables

P, I = ctypes.c_void_p, ctypes.c_int64


class Fp8Mat(ctypes.Structure):
    """wd_fp8_mat (csrc/wideep.h): an FP8 block-quantised matrix (e4m3 bytes, float32 block scales) for the
    fused calls, which take its address where a weight of dtype WD_FP8 goes."""
    _fields_ = fields("q s", P) + fields("lds br bk", I)


class MlaWeights(ctypes.Structure):
    """wd_mla_weights (csrc/wideep.h), an attention half's per-layer arguments: made once (engine/model/
    fused_weights.py mla_layer_weights), kept by the caller while the weights are the same memory."""
    _fields_ = (fields("in_w post_w wqa qa_w wq wkva kva_w wkvb wo", P)
                + fields("in_eps post_eps qa_eps kva_eps scale", ctypes.c_float)
                + fields("H Q N dn R C dv interleave wdt pwdt", I))


def mla_layer_buffer(w: MlaWeights, T: int, max_len: int) -> int:
    """Floats of scratch mla_layer needs for T tokens and contexts of up to max_len."""
    D = w.C + w.R
    return (T * (2 * w.H + w.Q + w.N * (w.dn + w.R) + 2 * D + w.R + w.N * w.R + w.N * D + w.N * w.C + w.N * w.dv)
            + w.N * (max_len + 1))


def _out(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


_scratch = threading.local()   # this thread's scratch for the fused layers: one buffer for all of them


def scratch(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """At least n elements of this thread's scratch of `dtype` (grown in steps of 1/4, so that a context
    growing by a token a step does not reallocate every step). Valid until the next call."""
    name = "i64" if dtype == torch.int64 else "f32"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n + n // 4 + 1024, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


class MlaLayerArgs(ctypes.Structure):
    """wd_mla_layer_args (csrc/wideep.h)."""
    _fields_ = (fields("w wuk_t x cos sin pool slots table lens h mlp_in buf", P)
                + fields("T S max_blocks max_len bs pdt", I))


def mla_layer(x: torch.Tensor, w: MlaWeights, w_uk_t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              kv_pool: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, max_len: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (each token the only query of its sequence), the layer's weights (mla_layer_weights)
    and W_UK^T (MLA.w_uk_t), cos/sin [T, R/2], a float32 or bfloat16 pool [S, C+R], slots [T], table [T, M],
    lens [T] int32 (AttnMeta.seq_tables) -> (h [T, H], mlp_in [T, H]) in x's dtype: the decoder layer's
    attention half in one call (the caller checks that every weight and input fits)."""
    T, H = x.shape
    dtype, x = x.dtype, as_f32(x)
    h, mlp_in = torch.empty(T, H), torch.empty(T, H)
    buf = scratch(mla_layer_buffer(w, T, max_len))
    rc = library().wd_mla_layer(MlaLayerArgs(
        w=ctypes.addressof(w), wuk_t=w_uk_t.data_ptr(), x=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
        pool=kv_pool.data_ptr(), slots=slots.data_ptr(), table=table.data_ptr(), lens=lens.data_ptr(), h=h.data_ptr(),
        mlp_in=mlp_in.data_ptr(), buf=buf.data_ptr(), T=T, S=kv_pool.shape[0], max_blocks=table.shape[1],
        max_len=max_len, bs=block_size, pdt=WDT[kv_pool.dtype]))
    if rc <= -2:
        raise ValueError(f"mla_layer: token {-2 - rc}'s slot {int(slots[-2 - rc])} is outside the pool's "
                         f"{kv_pool.shape[0]} rows")
    if rc:
        raise _bad_tables("mla_layer", lens, table, max_len, block_size, kv_pool.shape[0] // block_size)
    return _out(h, dtype), _out(mlp_in, dtype)


class MoeWeights(ctypes.Structure):
    """wd_moe_weights (csrc/wideep.h), an MoE half's per-layer arguments: made once (engine/model/
    fused_weights.py moe_layer_weights), kept by the caller while the weights are the same memory."""
    _fields_ = (fields("gw gbias w13 w2 sg su sd", P) + [("scale", ctypes.c_float)]
                + fields("H E I Is k G topk_group sigmoid method norm wdt", I) + fields("s13 s2", P)
                + fields("br bk sdt", I))


def moe_layer_scratch(w: MoeWeights, T: int) -> tuple[int, int]:
    """(int64s, floats) of scratch moe_layer needs for T tokens."""
    return 2 * (w.E + 1) + T * w.k, T * (w.E + w.H + max(2 * w.H + 3 * w.I, 2 * w.Is + w.H))


class MoeLayerArgs(ctypes.Structure):
    """wd_moe_layer_args (csrc/wideep.h)."""
    _fields_ = fields("w h x load ids iscratch out wts scratch", P) + fields("T", I)


def moe_layer(h: torch.Tensor, x: torch.Tensor, w: MoeWeights, load_counts: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, x [T, H] (the residual and the post-attention-normed mlp_in), the layer's weights
    (moe_layer_weights), load_counts [E] int64 or None -> (h + MoE(x) [T, H], topk_ids [T, k],
    topk_weights [T, k]): route, routed and shared experts, residual in one call (the caller checks that every
    weight and input fits); out in h's dtype."""
    T, H = x.shape
    dtype, h, x = h.dtype, as_f32(h), as_f32(x)
    out, ids, wts = torch.empty(T, H), torch.empty(T, w.k, dtype=torch.int64), torch.empty(T, w.k)
    ni, nf = moe_layer_scratch(w, T)
    rc = library().wd_moe_layer(MoeLayerArgs(
        w=ctypes.addressof(w), h=h.data_ptr(), x=x.data_ptr(),
        load=None if load_counts is None else load_counts.data_ptr(), ids=ids.data_ptr(),
        iscratch=scratch(ni, torch.int64).data_ptr(), out=out.data_ptr(), wts=wts.data_ptr(),
        scratch=scratch(nf).data_ptr(), T=T))
    if rc:
        raise RuntimeError(f"moe_layer: the router chose an expert past the {w.E} local ones (kernel code {rc})")
    return _out(out, dtype), ids, wts


class MlpWeights(ctypes.Structure):
    """wd_mlp_weights (csrc/wideep.h), a dense layer's SwiGLU MLP for mlp_layer and decode_stack (engine/model/
    fused_weights.py mlp_layer_weights)."""
    _fields_ = fields("sg su sd", P) + fields("H Is wdt", I)


def mlp_layer_scratch(w: MlpWeights, T: int) -> int:
    """Floats of scratch a dense layer's MLP half needs for T tokens."""
    return T * (w.H + 2 * w.Is)


class MlpLayerArgs(ctypes.Structure):
    """wd_mlp_layer_args (csrc/wideep.h)."""
    _fields_ = fields("w h x out scratch", P) + fields("T", I)


def mlp_layer(h: torch.Tensor, x: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """h, x [T, H] (the residual and the post-attention-normed mlp_in), a dense layer's MLP
    (mlp_layer_weights) -> h + MLP(x) [T, H] in one call (the SwiGLU of the shared experts), in h's dtype."""
    T, H = x.shape
    dtype, h, x = h.dtype, as_f32(h), as_f32(x)
    out = torch.empty(T, H)
    library().wd_mlp_layer(MlpLayerArgs(w=ctypes.addressof(w), h=h.data_ptr(), x=x.data_ptr(), out=out.data_ptr(),
                                        scratch=scratch(mlp_layer_scratch(w, T)).data_ptr(), T=T))
    return _out(out, dtype)


class LayerDesc(ctypes.Structure):
    """wd_layer_desc (csrc/wideep.h), one decoder layer for decode_stack: its structs (by address; the
    caller keeps them alive), its W_UK^T, its cache pool (float32 or bfloat16: pdt) and EPLB counts."""
    _fields_ = fields("mla wuk_t pool", P) + fields("S pdt", I) + fields("moe mlp load", P)


class DecodeStackArgs(ctypes.Structure):
    """wd_decode_stack_args (csrc/wideep.h)."""
    _fields_ = (fields("layers x0 cos sin slots table lens out wts buf ids ibuf failed", P)
                + fields("L T max_blocks max_len bs", I))


def decode_stack(x: torch.Tensor, layers, mla: list[MlaWeights], moe: list[MoeWeights | None],
                 mlp: list[MlpWeights | None], cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor, max_len: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's decoder layers in one call: x [T, H] (the embeddings), `layers` a ctypes array of
    LayerDesc (one a layer, in order; mla/moe/mlp the structs they point at, for the scratch sizes),
    cos/sin [T, R/2], slots [T], table [T, M], lens [T] int32 (AttnMeta.paged_decode_tables) -> (the last
    layer's output [T, H] in x's dtype, the MoE layers' topk_ids and topk_weights [n_moe, T, k]). Every
    layer runs what mla_layer and moe_layer (or the dense MLP) run, in order, the activations float32 from
    the first layer to the last (the caller checks that every layer fits)."""
    T, H = x.shape
    dtype, x = x.dtype, as_f32(x)
    moes = [w for w in moe if w is not None]
    k = moes[0].k if moes else 1
    need = max([mla_layer_buffer(w, T, max_len) for w in mla] + [moe_layer_scratch(w, T)[1] for w in moes]
               + [mlp_layer_scratch(w, T) for w in mlp if w is not None])
    ineed = max([moe_layer_scratch(w, T)[0] for w in moes], default=1)
    out = torch.empty(T, H)
    ids, wts = torch.empty(len(moes), T, k, dtype=torch.int64), torch.empty(len(moes), T, k)
    failed = ctypes.c_int64(-1)
    rc = library().wd_decode_stack(DecodeStackArgs(
        layers=ctypes.addressof(layers), x0=x.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
        slots=slots.data_ptr(), table=table.data_ptr(), lens=lens.data_ptr(), out=out.data_ptr(), wts=wts.data_ptr(),
        buf=scratch(4 * T * H + need).data_ptr(), ids=ids.data_ptr(), ibuf=scratch(ineed, torch.int64).data_ptr(),
        failed=ctypes.addressof(failed), L=len(mla), T=T, max_blocks=table.shape[1], max_len=max_len, bs=block_size))
    if rc <= -2:
        pool_rows = layers[failed.value].S
        raise ValueError(f"decode_stack: layer {failed.value}: token {-2 - rc}'s slot {int(slots[-2 - rc])} is "
                         f"outside the pool's {pool_rows} rows")
    if rc:
        raise _bad_tables(f"decode_stack: layer {failed.value}", lens, table, max_len, block_size,
                          layers[failed.value].S // block_size)
    return _out(out, dtype), ids, wts


class MtpPassArgs(ctypes.Structure):
    """wd_mtp_pass_args (csrc/wideep.h)."""
    _fields_ = (fields("layer ids embed enorm_w hnorm_w eh_w norm_w head_w prev cos sin rest_cos rest_sin ncos nsin "
                       "slots table rest rest_slots out_rows nslots lens nlens out wts buf pf tok moe_ids ibuf pi "
                       "failed", P)
                + fields("enorm_eps hnorm_eps norm_eps pad", ctypes.c_float)
                + fields("T n_in n_rest passes H V edt wdt max_blocks max_len bs", I))


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def mtp_pass(layer, mla: MlaWeights, moe: MoeWeights | None, mlp: MlpWeights | None, ids: torch.Tensor | None,
             embed: torch.Tensor | None, enorm: tuple[torch.Tensor, float], hnorm: tuple[torch.Tensor, float],
             eh_proj: torch.Tensor | None, prev: torch.Tensor, norm: tuple[torch.Tensor, float], head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
             lens: torch.Tensor, max_len: int, block_size: int, out_rows: torch.Tensor | None = None,
             rest: torch.Tensor | None = None, rest_slots: torch.Tensor | None = None,
             rest_cos: torch.Tensor | None = None, rest_sin: torch.Tensor | None = None,
             later: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A multi-token-prediction layer's draft passes in one call (engine/model/fused_mtp.py). The first, over the
    rows of prev [N, H] float32: with `embed` ([V, H], the target's, float32 or bfloat16), each row's input is
    eh_proj([enorm(embed[ids]) ; hnorm(prev)]), else prev itself. Rows `rest` [M] only write their cache entries
    (at rest_slots, with the RoPE of rest_cos/rest_sin [M, R/2]); rows out_rows [T] (None: all) run the decoder
    layer (`layer` a one-element LayerDesc array, its structs mla/moe/mlp, as decode_stack takes them; cos/sin,
    slots, table, lens theirs) and the head. later: (slots, lens int32, cos, sin), each [T, P - 1] (cos/sin
    [T, P - 1, R/2]): P - 1 more passes, each feeding a row's draft and output back in at its next position; a slot
    of -1 stops that row there. enorm, hnorm, norm: RMSNorms as (weight [H], eps); their weights, eh_proj [H, 2H] and
    head [V, H] are of one dtype, float32 or bfloat16. -> (each row's last layer output [T, H] float32, tokens [T, P] int64: each
    pass's argmax of head(norm(out)), the first of equal maxima as torch.argmax's; -1 past a row's stop)."""
    N, H = prev.shape
    T = N if out_rows is None else out_rows.shape[0]
    M = 0 if rest is None else rest.shape[0]
    V = head.shape[0]
    D = mla.C + mla.R
    nslots, nlens, ncos, nsin = later if later is not None else (None,) * 4
    Pn = 1 if later is None else nslots.shape[1] + 1
    if later is not None:
        max_len = max(max_len, int(nlens.max()))
        if int(nslots.max()) >= layer[0].S:
            raise ValueError(f"mtp_pass: a later pass's slot {int(nslots.max())} is outside the pool's {layer[0].S} "
                             f"rows")
    need = max(mla_layer_buffer(mla, T, max_len), moe_layer_scratch(moe, T)[1] if moe is not None else 0,
               mlp_layer_scratch(mlp, T) if mlp is not None else 0)
    ineed = moe_layer_scratch(moe, T)[0] if moe is not None else 1
    k = moe.k if moe is not None else 1
    out, tok = torch.empty(T, H), torch.empty(T, Pn, dtype=torch.int64)
    moe_ids, wts = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    failed = ctypes.c_int64(-1)
    wdt = WDT[head.dtype]
    fbase = 3 * N * H + T * H + max(M * (H + 3 * D), 4 * T * H + need, T * (H + V))
    buf = scratch(fbase + (T * (3 * H + mla.R) if Pn > 1 else 0))
    ibuf = scratch(ineed + (T * (5 + table.shape[1]) if Pn > 1 else 0), torch.int64)
    rc = library().wd_mtp_pass(MtpPassArgs(
        layer=ctypes.addressof(layer), ids=_ptr(ids), embed=_ptr(embed), enorm_w=enorm[0].data_ptr(),
        hnorm_w=hnorm[0].data_ptr(), eh_w=_ptr(eh_proj), norm_w=norm[0].data_ptr(), head_w=head.data_ptr(),
        prev=prev.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), rest_cos=_ptr(rest_cos),
        rest_sin=_ptr(rest_sin), ncos=_ptr(ncos), nsin=_ptr(nsin), slots=slots.data_ptr(), table=table.data_ptr(),
        rest=_ptr(rest), rest_slots=_ptr(rest_slots), out_rows=_ptr(out_rows), nslots=_ptr(nslots),
        lens=lens.data_ptr(), nlens=_ptr(nlens), out=out.data_ptr(), wts=wts.data_ptr(), buf=buf.data_ptr(),
        pf=buf.data_ptr() + 4 * fbase if Pn > 1 else None, tok=tok.data_ptr(), moe_ids=moe_ids.data_ptr(),
        ibuf=ibuf.data_ptr(), pi=ibuf.data_ptr() + 8 * ineed if Pn > 1 else None, failed=ctypes.addressof(failed),
        enorm_eps=enorm[1], hnorm_eps=hnorm[1], norm_eps=norm[1], T=T, n_in=N, n_rest=M, passes=Pn, H=H, V=V,
        edt=WDT[embed.dtype] if embed is not None else wdt, wdt=wdt, max_blocks=table.shape[1], max_len=max_len,
        bs=block_size))
    if rc <= -2:
        r = -2 - rc
        rows, at = (rest.tolist(), rest_slots) if rest is not None and r in rest.tolist() else (
            list(range(N)) if out_rows is None else out_rows.tolist(), slots)
        raise ValueError(f"mtp_pass: row {r}'s slot {int(at[rows.index(r)])} is outside the pool's {layer[0].S} rows")
    if rc:
        raise _bad_tables("mtp_pass", lens, table, max_len, block_size, layer[0].S // block_size)
    return out, tok


register({"wd_mla_layer": (MlaLayerArgs, I), "wd_moe_layer": (MoeLayerArgs, I), "wd_mlp_layer": (MlpLayerArgs, None),
          "wd_decode_stack": (DecodeStackArgs, I), "wd_mtp_pass": (MtpPassArgs, I)},
         {"wd_mla_weights": MlaWeights, "wd_moe_weights": MoeWeights, "wd_mlp_weights": MlpWeights,
          "wd_layer_desc": LayerDesc, "wd_fp8_mat": Fp8Mat})
