"""The MLA family's decode step as fused CPU calls: the one component that decides, once per plain step, whether
the step's decoder layers (model.py DeepseekModel) run as the C calls of cpu/fused.py, and counts why when they do
not. It is the model's, not the kernels': it reads the model's modules (the checks and structs: fused_weights.py;
the MTP layer's passes: fused_mtp.py); cpu/ holds the kernels and their launchers only.

Paths (the model's backends["decode"] names the one the last step took; stats() counts them):
  stack   every decoder layer in one C call (fused.decode_stack): Python run between two layers' weight
          streams finds the caches emptied and costs ~10x, so the whole stack is checked before one call.
          Needs one EP rank, no EPLB map, no per-layer hook, every layer's halves fusable, and every token of
          the step a query on the paged kernel: decodes, and on the cpu backend any step of at most
          attention_mla/mla.py PAGED_STEP_TOKENS tokens (prefill chunks, mixed steps, speculative verification;
          MLA.paged_chunk: one kernel row a token, each seeing its sequence up to its own position).
  layers  per layer: the attention half in one call (fused.mla_layer: norm, projections, RoPE, cache
          write, paged decode, output projection, residual, post-norm), the per-layer hook, then the
          MoE half in one call (fused.moe_layer) when every expert is local and unmapped, else the
          layer's own MoE operations — router, dispatch, local experts, combine: the EP group's
          all-to-all runs between the fused halves — or a dense layer's MLP half in one call
          (fused.mlp_layer).
  mlp_halves  a step of at most max_rows tokens (cpu/linear.py: 64; bfloat16 weights on AMX tiles 256, or 16 where
          the CPU has them but the C does not use them) whose attention is not all on the paged kernel (a prompt
          in the naive form): the attention as its operations, the MoE / MLP halves as in `layers`.
  ops     the model's step_ops (big steps, DSA, an fp8 or fp4 cache, ...), its reason counted. A packed
          latent cache (fp8 / fp4) is declined: the fused layer call writes and reads float32 / bfloat16
          rows; its attention runs on the C paged decode (mla_decode reads both packed layouts) instead.
Fused or not is measured on this model, on this machine (unless WIDEEP_CPU_TUNE=off, cpu/tune.py: then a step that
fits is fused): for each (path, rows rounded up to a power of two) the first steps take turns between the fused calls
and the model's operations (the operations' own kernels chosen by cpu/tune.py), CALIBRATION_STEPS timed steps each
after an untimed one, counted as "calibrating" when the operations run; the faster side then takes every such step
(the operations' steps counted as "measured_slower"; calibration_ms has each side's best).
Each fused call runs the kernels the operations run, in their order: the outputs, caches, EPLB load
counts and dispatcher counters equal the operations' (tests/engine/test_fused_decode.py).
A float32 model or a bfloat16 one (every weight of the layers in one dtype, the router's float32 as
moe/gate.py keeps it; the latent cache float32 or bfloat16): the C reads bfloat16 weights as stored and
keeps the activations float32 inside each call (the stack path: from the first layer to the last).
An fp8 checkpoint kept as stored (quantization "auto"/"fp8" on the CPU kernels) is fused too: its projections
and routed / shared experts go to C as e4m3 bytes + block scales (fused.Fp8Mat, the MoE struct's scales), read
as stored by the fp8 GEMM; the norms, kv_b_proj and W_UK^T stay in the model dtype.

The layers' weights go to C as structs built once, on first use, kept with the tensors they point into (a pointer
never outlives its memory); invalidate() after replacing a parameter object. Writes in place (loading, EPLB's
moves) need nothing.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import torch

from wideep.attention_mla.mla import PAGED_STEP_TOKENS
from wideep.cpu import fused, tune
from wideep.cpu.linear import ROWS_CAP, builtin_max_rows
from wideep.dbo.state import Microbatch, OpState
from wideep.moe.layer import MoELayer

from . import fused_mtp
from .fused_weights import (WEIGHT_DTYPES, attention_unfit, mla_layer_weights, mlp_layer_weights, mlp_unfit,
                            moe_layer_weights, moe_unfit)
from .model import CARRY, DecoderLayer, DeepseekModel
from .mtp import MTPLayer

# why a step ran its operations (every plain step is counted once: a path, or one of these)
REASONS = ("no_tokens", "measured_slower", "calibrating", "too_many_rows", "sparse_attention", "fp8_kv_cache",
           "fp4_kv_cache", "weights_unfit", "not_all_decode", "kv_pool")
# timed steps of each side per (path, rows) bucket before the plan keeps the faster (cpu/tune.py's switch)
CALIBRATION_STEPS = 3
# why a fused step ran layer by layer instead of as one stack call
STACK_REASONS = ("disabled", "layer_hook", "ep_group", "expert_map", "moe_unfit")


@dataclass
class _Layer:
    """One decoder layer's structs (None: that half does not fit; why in DecodePlan.unfit) and its ops."""
    mla: fused.MlaWeights | None = None
    moe: fused.MoeWeights | None = None
    mlp: fused.MlpWeights | None = None
    keep: list = field(default_factory=list)   # the tensors the structs point into
    attn_op: object = None
    moe_op: object = None      # the MoE half in one call (None: the layer's MoE operations)
    mlp_op: object = None      # a dense layer's MLP half in one call
    moe_ops: list = field(default_factory=list)
    fits: bool = True          # (extra layers) both halves fused
    desc: object = None        # (extra layers) its LayerDesc for one call (extra_layer_call)


class DecodePlan:
    def __init__(self, model: DeepseekModel, fuse_stack: bool = True):
        """model: an engine DeepseekModel built with the CPU kernel table. fuse_stack: the whole-stack call
        (EngineConfig.fuse_decode_stack); off, fused steps run layer by layer."""
        self.model, self.fuse_stack = model, fuse_stack
        self.steps = {"stack": 0, "layers": 0, "mlp_halves": 0, "ops": 0}
        self.declined = dict.fromkeys(REASONS, 0)
        self.stack_declined = dict.fromkeys(STACK_REASONS, 0)
        self.unfit: dict[str, str] = {}       # "layer 3 attention" -> why that half cannot be fused (no fused step)
        self.moe_unfit: dict[int, str] = {}   # MoE layer -> why its half runs as its operations
        self._layers: list[_Layer] | None = None
        self._extra: dict[int, _Layer] = {}   # layers outside the stack (extra_layer_ops), by id
        self._tuning = tune.tuning()
        self.calibration: dict[tuple[str, int], str] = {}   # (path, rows bucket) -> "fused" | "ops", as measured
        self.calibration_ms: dict[tuple[str, int], dict] = {}   # -> the best step ms of each side
        self._timings: dict[tuple[str, int], dict] = {}

    # -- the decision -------------------------------------------------------------------------------
    def ops_for(self, mb: Microbatch) -> list:
        """The operations of a plain step of microbatch `mb` (dbo/state.py Microbatch): fused ones, or the
        model's step_ops, decided here once for the whole step."""
        why = self._why_not(mb)
        if why is not None and why != "not_all_decode":
            self.declined[why] += 1
            return self._took("ops", self.model.step_ops)
        stack_why = None if why is not None else self._why_not_stack(mb)
        path = "mlp_halves" if why is not None else "stack" if stack_why is None else "layers"
        bucket = (path, 1 << (mb.input_ids.shape[0] - 1).bit_length())
        trial = self._calibrating(bucket)
        side = trial or self.calibration.get(bucket, "fused")
        if side == "ops":   # this model's operations measured faster here (or being measured)
            self.declined["calibrating" if trial else "measured_slower"] += 1
            ops = self._took("ops", self.model.step_ops)
        else:
            if why is not None:   # a small prefill or mixed step: attention as operations, MLP halves fused
                self.declined[why] += 1
            elif stack_why is not None:
                self.stack_declined[stack_why] += 1
            ops = self._took(path, self._layer_ops(mb, attention=False) if why is not None
                             else self._stack_ops if stack_why is None else self._layer_ops(mb))
        return self._timed(bucket, side, ops) if trial else ops

    # -- fused or operations, measured on this model (cpu/tune.py's switch) ------------------------------
    def _calibrating(self, bucket) -> str | None:
        """While a (path, rows rounded up to a power of two) bucket is being measured: which side this step runs
        ("fused" / "ops", in turns, CALIBRATION_STEPS timed steps each after one untimed step each); None once it is
        decided (self.calibration[bucket]) or when the choices are not measured (WIDEEP_CPU_TUNE=off: fused)."""
        if bucket in self.calibration or not self._tuning:
            return None
        t = self._timings.setdefault(bucket, {"fused": [], "ops": []})
        f, o = len(t["fused"]), len(t["ops"])
        if min(f, o) > CALIBRATION_STEPS:
            best = {k: min(v[1:]) for k, v in t.items()}
            self.calibration[bucket] = "fused" if best["fused"] <= best["ops"] else "ops"
            self.calibration_ms[bucket] = {k: round(v * 1e3, 3) for k, v in best.items()}
            return None
        return "fused" if f <= o else "ops"

    def _timed(self, bucket, side: str, ops: list) -> list:
        """ops between two that time them (the step's layers, this rank's wall time) into the bucket's trials."""
        t = self._timings[bucket][side]
        start = []

        def op_calibration_start(s: OpState) -> None:
            start.append(time.perf_counter())

        def op_calibration_stop(s: OpState) -> None:
            t.append(time.perf_counter() - start[0])
        return [op_calibration_start, *ops, op_calibration_stop]

    def _took(self, path: str, ops: list) -> list:
        self.steps[path] += 1
        self.model.backends["decode"] = path
        return ops

    def _why_not(self, mb: Microbatch) -> str | None:
        T = mb.input_ids.shape[0]
        if T == 0:
            return "no_tokens"
        if T > ROWS_CAP:      # past it the projections run on BLAS: the fused calls would not be the same kernels
            return "too_many_rows"
        if mb.index_pools is not None:
            return "sparse_attention"
        layers = self._built()
        if T > self._max_rows:   # this dtype's crossover (cpu/linear.py max_rows: 64; bfloat16 on AMX 16 or 256)
            return "too_many_rows"
        if self.unfit:
            return self._unfit_reason
        if self._tables(mb.meta, T) is None:
            return "not_all_decode"
        D = self._latent_width
        if not all(p.dtype in WEIGHT_DTYPES and p.dim() == 2 and p.shape[1] == D and p.is_contiguous()
                   and not p.is_cuda for p in mb.kv_pools[:len(layers)]):
            return "kv_pool"
        return None

    def _tables(self, meta, T: int):
        """The step's paged tables, one row a token (AttnMeta.paged_decode_tables with the chunk MLA.forward
        uses for a step of T tokens: a short prefill or mixed step attends on the paged kernel too), or None when
        some token's attention is another form."""
        return meta.paged_decode_tables(self._mode, self._attn.paged_chunk(T))

    def _why_not_stack(self, mb: Microbatch) -> str | None:
        if not self.fuse_stack:
            return "disabled"
        if mb.on_layer is not None:
            return "layer_hook"
        if not getattr(mb.dispatcher, "local_only", False):
            return "ep_group"
        for layer, w in zip(self.model.model.layers, self._layers):
            if layer.is_moe:
                if layer.mlp.expert_map is not None:
                    return "expert_map"
                if w.moe is None or not self._counts_fit(layer.mlp):
                    return "moe_unfit"
        return None

    @staticmethod
    def _counts_fit(moe: MoELayer) -> bool:
        lc = moe.load_counts
        return lc is None or (lc.dtype == torch.int64 and lc.is_contiguous() and not lc.is_cuda
                              and lc.shape == (moe.cfg.n_routed_experts,))

    def _layer_ops(self, mb: Microbatch, attention: bool = True) -> list:
        model, local = self.model, getattr(mb.dispatcher, "local_only", False)
        ops = [model.op_embed]
        for layer, w in zip(model.model.layers, self._layers):
            ops += self._halves(layer, w, local, attention)
        ops.append(model.op_final_norm)
        return ops

    def _halves(self, layer: DecoderLayer, w: _Layer, local: bool, attention: bool = True) -> list:
        """One layer's operations: its fused attention half (or its own), then its fused MLP / MoE half where
        every expert is local and unmapped, else the MoE's own operations."""
        ops = [w.attn_op if attention else layer.op_attention, layer.op_kv_written]
        if not layer.is_moe:
            return ops + [w.mlp_op]
        if w.moe_op is not None and local and layer.mlp.expert_map is None and self._counts_fit(layer.mlp):
            return ops + [w.moe_op]
        return ops + w.moe_ops

    def extra_layer_ops(self, layer: DecoderLayer, mb: Microbatch) -> list | None:
        """The fused halves of a decoder layer outside the model's stack (speculative decoding's MTP layer,
        its latents in kv_pools[layer.index]) for microbatch mb, or None (then it runs its own operations):
        every row a decode row of at most max_rows, and the layer's halves fit as the stack's would."""
        w = self._extra_fits(layer, mb, mb.input_ids.shape[0])
        return None if w is None else self._halves(layer, w, getattr(mb.dispatcher, "local_only", False))

    def _extra_fits(self, layer: DecoderLayer, mb: Microbatch, rows: int) -> _Layer | None:
        T = mb.input_ids.shape[0]
        if T == 0 or rows > ROWS_CAP or mb.index_pools is not None:
            return None
        self._built()
        if rows > self._max_rows:
            return None
        if mb.meta.paged_decode_tables(self._mode) is None:
            return None
        w = self._extra.get(id(layer))
        if w is None:
            saved = self.unfit, self.moe_unfit
            self.unfit, self.moe_unfit = {}, {}
            w = self._layer(layer.index, layer)
            w.fits = not self.unfit
            self.unfit, self.moe_unfit = saved
            self._extra[id(layer)] = w
        return w if w.fits else None

    def extra_layer_call(self, layer: DecoderLayer, mb: Microbatch, rows: int):
        """The layer outside the stack (extra_layer_ops) as one call, decode_stack's, for microbatch mb (its rows
        run the layer) within a call that computes `rows` (>= mb's) rows in all: -> (a one-element LayerDesc array with this
        step's fields set, its _Layer) where its halves fuse and its MoE is local, unmapped and fused (a layer of
        the stack path's kind), else None."""
        w = self._extra_fits(layer, mb, rows)
        if w is None or not getattr(mb.dispatcher, "local_only", False):
            return None
        if layer.is_moe and (w.moe is None or layer.mlp.expert_map is not None or not self._counts_fit(layer.mlp)):
            return None
        if w.desc is None:
            w.desc = (fused.LayerDesc * 1)()
            w.desc[0].mla = ctypes.addressof(w.mla)
            w.desc[0].moe = ctypes.addressof(w.moe) if w.moe is not None else None
            w.desc[0].mlp = ctypes.addressof(w.mlp) if w.mlp is not None else None
        d, pool = w.desc[0], mb.kv_pools[layer.index]
        d.wuk_t, d.pool, d.S, d.pdt = layer.self_attn.w_uk_t().data_ptr(), pool.data_ptr(), pool.shape[0], \
            fused.WDT[pool.dtype]
        lc = layer.mlp.load_counts if layer.is_moe else None
        d.load = lc.data_ptr() if lc is not None else None
        return w.desc, w

    # -- the MTP layer's draft passes (fused_mtp.py) ------------------------------------------------------------
    def mtp_fits(self, mtp: MTPLayer) -> bool:
        """Whether the MTP layer's own weights (its norms, eh_proj, head, the embeddings) fit one fused.mtp_pass
        call; its decoder layer is judged per call (extra_layer_call)."""
        return fused_mtp.fits(mtp)

    def mtp_passes(self, mtp: MTPLayer, token_ids: torch.Tensor, prev: torch.Tensor, meta, kv_pools: list, plan,
                   rows: tuple | None = None, later: tuple | None = None
                   ) -> tuple[torch.Tensor, list[list[int]], int] | None:
        """The MTP layer's pass (with `later`, its passes) as one fused.mtp_pass call -> (out, each row's drafts,
        passes), or None where its layer does not fuse for these rows (then nothing was done): fused_mtp.passes."""
        return fused_mtp.passes(self, mtp, token_ids, prev, meta, kv_pools, plan, rows, later)

    def step_tokens(self) -> int | None:
        """The most tokens a step of short prompts and decodes may hold and still run fused (the scheduler's
        mixed_step_tokens by default): the paged kernel's step size on the cpu backend within the dtype's row
        limit; None when the attention pages decodes only (another backend, a forced form) or the plan never fuses
        a step (DSA's sparse attention, a packed fp8 / fp4 latent cache)."""
        attn = self.model.model.layers[0].self_attn
        if self.model.cfg.dsa is not None or any(a.self_attn.kv_fp8 is not None for a in self.model.model.layers):
            return None
        n = min(attn.paged_chunk(PAGED_STEP_TOKENS), builtin_max_rows(attn.o_proj.weight.dtype))
        return n if n > 1 else None

    def stats(self) -> dict:
        """Flat counters for the rank's stats: decode_steps_<path>, decode_declined_<reason>,
        decode_stack_declined_<reason>, decode_fused_<path>_<rows> (1: measured faster fused, 0: as operations)."""
        return {**{f"decode_steps_{k}": v for k, v in self.steps.items()},
                **{f"decode_fused_{p}_{rows}": int(c == "fused") for (p, rows), c in self.calibration.items()},
                **{f"decode_declined_{k}": v for k, v in self.declined.items()},
                **{f"decode_stack_declined_{k}": v for k, v in self.stack_declined.items()}}

    def invalidate(self) -> None:
        """Forget the weight structs (after a parameter object was replaced): rebuilt at the next step."""
        self._layers = None

    # -- the weight structs and fused operations, built once ------------------------------------------
    def _built(self) -> list[_Layer]:
        if self._layers is None:
            self.unfit, self.moe_unfit = {}, {}
            layers = self.model.model.layers
            attn = layers[0].self_attn
            self._mode, self._attn = attn.mode, attn
            self._latent_width = attn.cfg.kv_lora_rank + attn.cfg.qk_rope_head_dim
            self._max_rows = builtin_max_rows(attn.o_proj.weight.dtype)
            self._layers = [self._layer(i, layer) for i, layer in enumerate(layers)]
            packed = {a.self_attn.kv_fp8.name for a in layers if a.self_attn.kv_fp8 is not None}
            self._unfit_reason = ("fp4_kv_cache" if "fp4_e2m1" in packed else "fp8_kv_cache" if packed
                                  else "weights_unfit")
            self._descs = self._stack_descs()
            self._stack_ops = [self.model.op_embed, self._op_stack, self.model.op_final_norm]
        return self._layers

    def _layer(self, i: int, layer: DecoderLayer) -> _Layer:
        w = _Layer(moe_ops=layer.mlp_ops())
        why = attention_unfit(layer)
        if why:
            self.unfit[f"layer {i} attention"] = why
        else:
            a = layer.self_attn
            w.mla = mla_layer_weights(layer.input_layernorm, layer.post_attention_layernorm, a)
            w.keep += [*a.parameters(), layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            w.attn_op = self._attention_op(i, layer, w.mla)
        if layer.is_moe:
            why = moe_unfit(layer.mlp)
            if why:   # the layer's MoE operations run instead: not a reason to leave the fused path
                self.moe_unfit[i] = why
            else:
                m = layer.mlp
                ex = m.experts
                if ex.limit is not None or ex.fp4:   # wd_moe_weights has neither (V4 models build no plan)
                    raise ValueError("the fused CPU decode takes no clamped SwiGLU and no fp4 experts")
                scales = (ex.w13_scale_inv, ex.w2_scale_inv, ex.fp8_block) if ex.fp8_block is not None else None
                w.moe = moe_layer_weights(m.gate, ex.w13, ex.w2, m.shared_experts, scales)
                w.keep += list(m.parameters())
                w.moe_op = self._moe_op(i, m, w.moe)
        else:
            why = mlp_unfit(layer.mlp)
            if why:
                self.unfit[f"layer {i} mlp"] = why
            else:
                w.mlp = mlp_layer_weights(layer.mlp)
                w.keep += list(layer.mlp.parameters())
                w.mlp_op = self._mlp_op(i, w.mlp)
        return w

    def _attention_op(self, i: int, layer: DecoderLayer, w: fused.MlaWeights):
        attn, mode = layer.self_attn, self._mode

        def op_attention_half(s: OpState) -> None:
            mb = s.inputs
            meta = mb.meta
            cos, sin = s.peek("rope")
            table, lens, max_len = self._tables(meta, mb.input_ids.shape[0])
            h, mlp_in = fused.mla_layer(s.take("x"), w, attn.w_uk_t(), cos, sin, mb.kv_pools[i], meta.slot_mapping,
                                        table, lens, max_len, meta.block_size)
            s.put(h=h, mlp_in=mlp_in)
        return op_attention_half

    def _moe_op(self, i: int, moe: MoELayer, w: fused.MoeWeights):
        def op_moe_half(s: OpState) -> None:
            h, x = s.take("h"), s.take("mlp_in")
            out, _, _ = fused.moe_layer(h, x, w, moe.load_counts)
            s.inputs.dispatcher.account_local(x.shape[0])
            s.put(x=out)
            s.end_layer(i, CARRY)
        return op_moe_half

    def _mlp_op(self, i: int, w: fused.MlpWeights):
        def op_mlp_half(s: OpState) -> None:
            h, x = s.take("h"), s.take("mlp_in")
            s.put(x=fused.mlp_layer(h, x, w))
            s.end_layer(i, CARRY)
        return op_mlp_half

    def _stack_descs(self):
        """decode_stack's layer table; the per-step fields (W_UK^T, pool, counts) are set by _op_stack."""
        if self.unfit:
            return None
        descs = (fused.LayerDesc * len(self._layers))()
        for d, w in zip(descs, self._layers):
            d.mla = ctypes.addressof(w.mla)
            d.moe = ctypes.addressof(w.moe) if w.moe is not None else None
            d.mlp = ctypes.addressof(w.mlp) if w.mlp is not None else None
        return descs

    def _op_stack(self, s: OpState) -> None:
        mb = s.inputs
        meta, descs, layers = mb.meta, self._descs, self.model.model.layers
        cos, sin = s.peek("rope")
        x = s.take("x")
        table, lens, max_len = self._tables(meta, x.shape[0])
        for d, layer, pool in zip(descs, layers, mb.kv_pools):
            d.wuk_t, d.pool, d.S = layer.self_attn.w_uk_t().data_ptr(), pool.data_ptr(), pool.shape[0]
            d.pdt = fused.WDT[pool.dtype]
            lc = layer.mlp.load_counts if layer.is_moe else None
            d.load = lc.data_ptr() if lc is not None else None
        ws = self._layers
        out, ids, _ = fused.decode_stack(x, descs, [w.mla for w in ws], [w.moe for w in ws], [w.mlp for w in ws],
                                         cos, sin, meta.slot_mapping, table, lens, max_len, meta.block_size)
        if ids.shape[0]:
            mb.dispatcher.account_local(x.shape[0], layers=ids.shape[0])
        s.put(x=out)
