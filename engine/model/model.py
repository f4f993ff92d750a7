"""DeepSeek-V2/V3/V3.2-class decoder (GLM-4.x-MoE-lite and Kimi-K2.5's text model too) assembled from
wideep's MLA (SparseMLA for V3.2's DeepSeek Sparse Attention) and MoE modules.

Legend: T tokens in the step (all sequences flattened), H hidden, V vocab.
Parameter names follow the HF checkpoint, so `checkpoint_targets` is mostly the identity; routed
experts are stacked per layer (w13 [El, 2I, H], w2 [El, H, I]) and the checkpoint's
per-expert tensors are views into them. With `fp8_block` the routed experts and the attention/MLP
projections keep the fp8 checkpoint's values and block scales (`*_scale_inv` become targets too);
kv_b_proj, norms, router, embeddings and lm_head are dequantised / high precision as usual.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from attention_mla.meta import AttnMeta
from attention_mla.mla import MLA
from attention_mla.norm import RMSNorm
from attention_mla.rope import RotaryEmbedding
from attention_mla.sparse_mla import SparseMLA
from cpu.linear import Linear as CpuLinear
from cpu.linear import small_linear
from dbo.schedule import run_sequential
from dbo.state import Microbatch, OpState
from moe.backend import ExpertsChoice
from moe.fp8_linear import Fp8Linear
from moe.layer import ExpertShard, MoELayer
from moe.mlp import MLP
from parallel.step_plan import StepPlan

from .model_config import ModelConfig

CARRY = ("x", "rope")   # what one layer hands the next: hidden states [T, H], this step's (cos, sin)


@contextmanager
def _skip_init():
    """nn.Module constructors' parameter initialisers do nothing (the loader overwrites every parameter)."""
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
             "xavier_normal_", "ones_", "zeros_", "constant_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def expert_targets(experts, layer: int, expert: int, slot: int) -> dict[str, torch.Tensor]:
    """Checkpoint names of logical `expert` of decoder layer `layer` -> views into local `slot` of
    `experts` (moe.experts.Experts): gate rows then up rows of w13, w2, and the fp8 block scales."""
    I = experts.intermediate
    pre = f"model.layers.{layer}.mlp.experts.{expert}."
    out = {pre + "gate_proj.weight": experts.w13.data[slot, :I], pre + "up_proj.weight": experts.w13.data[slot, I:],
           pre + "down_proj.weight": experts.w2.data[slot]}
    if experts.fp8_block is not None:  # gate's scale rows, then up's (moe/fp8.py layout)
        rows = -(-I // experts.fp8_block[0])
        out |= {pre + "gate_proj.weight_scale_inv": experts.w13_scale_inv.data[slot, :rows],
                pre + "up_proj.weight_scale_inv": experts.w13_scale_inv.data[slot, rows:],
                pre + "down_proj.weight_scale_inv": experts.w2_scale_inv.data[slot]}
    return out


def _materialize(module: nn.Module, device) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device` (Module.to_empty, but
    through torch.empty with the shape: empty_like on meta imports sympy, ~0.7 s per process)."""
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = torch.empty(t.shape, dtype=t.dtype, device=device)
                table[name] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


class DecoderLayer(nn.Module):
    """norm -> MLA -> + residual -> norm -> dense MLP | MoE -> + residual, as operations on an OpState
    (dbo/state.py) that holds "x" [T, H] and "rope" (cos, sin [T, R/2]) between layers."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, shard: ExpertShard | None,
                 experts: ExpertsChoice, attention: str, device=None, dtype=None, fp8_block=None,
                 kv_cache_dtype: str = "auto"):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        cpu = self.cpu = experts.backend == "cpu"   # the C kernels for norms and projections too (cpu/)
        linear = (Fp8Linear.factory(fp8_block) if fp8_block is not None
                  else CpuLinear if cpu else nn.Linear)
        self.index = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernel=cpu, **kw)
        kw_attn = dict(kw, linear=linear, backend=attention, kv_cache_dtype=kv_cache_dtype)
        self.self_attn = (MLA(cfg.mla, rope, **kw_attn) if cfg.dsa is None
                          else SparseMLA(cfg.mla, cfg.dsa, rope, **kw_attn))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernel=cpu, **kw)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = (MoELayer(cfg.moe, shard, fp8_block=fp8_block, linear=linear, experts_backend=experts.backend,
                             deepgemm=experts.deepgemm, **kw) if self.is_moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, linear=linear, **kw))
        # the operations after attention, which op_moe_half / op_mlp_half run when they cannot fuse
        self.half_ops = [*self.mlp.ops(), self.op_residual] if self.is_moe else [self.op_dense_mlp, self.op_residual]

    def ops(self) -> list:
        """attention, kv_written (on_layer), the MLP's or MoE's operations (moe/layer.py), residual."""
        mlp = self.mlp.ops() if self.is_moe else [self.op_dense_mlp]
        return [self.op_attention, self.op_kv_written, *mlp, self.op_residual]

    def op_attention(self, s: OpState) -> None:
        mb, x = s.inputs, s.take("x")
        cos, sin = s.peek("rope")
        if mb.index_pools is None:   # a decode step on the CPU kernels: the whole half in one call
            fused = self.self_attn.decode_layer(x, mb.meta, mb.kv_pools[self.index], cos, sin, self.input_layernorm,
                                                self.post_attention_layernorm)
            if fused is not None:
                s.put(h=fused[0], mlp_in=fused[1])
                return
        # DSA layers also write and read their indexer keys (the same slots in index_pools)
        extra = {} if mb.index_pools is None else {"index_pool": mb.index_pools[self.index]}
        h = x + self.self_attn(self.input_layernorm(x), mb.meta, mb.kv_pools[self.index], cos, sin, **extra)
        s.put(h=h, mlp_in=self.post_attention_layernorm(h))

    def fused_ops(self) -> list:
        """ops() for a plain (not DBO) step: on the C kernels a layer ends in op_moe_half or
        op_mlp_half, which run its half after attention in one call when they can and the same
        operations otherwise."""
        if not self.cpu:
            return self.ops()
        return [self.op_attention, self.op_kv_written, self.op_moe_half if self.is_moe else self.op_mlp_half]

    def op_mlp_half(self, s: OpState) -> None:
        """A dense layer's MLP and residual in one C call (cpu/fused.py mlp_layer) when its weights fit
        and the tokens are few (cpu.linear.MAX_ROWS, past which BLAS runs the projections); else
        op_dense_mlp and op_residual."""
        from cpu.fused import f32_rows
        from cpu.linear import MAX_ROWS
        h, x = s.peek("h"), s.peek("mlp_in")
        T, H = x.shape
        w = self.mlp.fused() if 0 < T <= MAX_ROWS and f32_rows(x, T, H) and f32_rows(h, T, H) else None
        if w is None:
            run_sequential(self.half_ops, s)
            return
        from cpu.fused import mlp_layer
        s.take("h")
        s.take("mlp_in")
        s.put(x=mlp_layer(h, x, w))
        s.end_layer(self.index, CARRY)

    def op_moe_half(self, s: OpState) -> None:
        out = self.mlp.decode_layer(s.peek("h"), s.peek("mlp_in"), s.inputs.dispatcher)
        if out is None:
            run_sequential(self.half_ops, s)
            return
        s.take("h")
        s.take("mlp_in")
        s.put(x=out)
        s.end_layer(self.index, CARRY)

    def fused(self, mb: Microbatch):
        """This layer in a whole-step decode call (DeepseekModel.op_layers), when it can be: its
        attention half's struct, and its MoE half's or dense MLP's -> (MlaWeights, MoeWeights | None,
        MlpWeights | None), or None."""
        a = self.self_attn.fused(mb.kv_pools[self.index], self.input_layernorm, self.post_attention_layernorm)
        if a is None:
            return None
        m = self.mlp.fused(mb.dispatcher) if self.is_moe else self.mlp.fused()
        if m is None:
            return None
        return (a, m, None) if self.is_moe else (a, None, m)

    def op_kv_written(self, s: OpState) -> None:
        """This layer's latents are in kv_pools[index]: disaggregation may start sending them."""
        if s.inputs.on_layer is not None:
            s.inputs.on_layer(self.index)

    def op_dense_mlp(self, s: OpState) -> None:
        s.put(mlp_out=self.mlp(s.take("mlp_in")))

    def op_residual(self, s: OpState) -> None:
        s.put(x=s.take("h") + s.take("mlp_out"))
        s.end_layer(self.index, CARRY)


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, shard, experts: ExpertsChoice, attention: str,
                 device=None, dtype=None, fp8_block=None, kv_cache_dtype: str = "auto"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, shard, experts, attention, device, dtype, fp8_block,
                                                 kv_cache_dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype,
                            kernel=experts.backend == "cpu")


class DeepseekModel(nn.Module):
    """`shard` (this rank's experts) and `dispatcher` (parallel.dispatch; LocalDispatcher on one EP
    rank) serve the MoE layers; attention, dense layers, shared experts, embeddings and lm_head are
    replicated on every rank. `experts` and `attention` are the resolved backends (moe/backend.py,
    attention_mla/paged_decode.py), given to the layers when they are built.

    The forward is `step_ops` (dbo/schedule.py): embed, every layer's operations, final norm, on an
    OpState per microbatch (dbo/state.py). dbo.overlap.Overlap runs two microbatches through it;
    forward() runs `plain_ops`: embed, op_layers, final norm, where op_layers runs the same layers'
    operations (each layer's half after attention in one C call on the C kernels when it can:
    DecoderLayer.fused_ops), or on a CPU decode step all the layers in one C call (cpu/fused.py
    decode_stack)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 shard: ExpertShard | None = None, dispatcher=None, fp8_block: tuple[int, int] | None = None,
                 experts: ExpertsChoice | None = None, attention: str = "torch", kv_cache_dtype: str = "auto"):
        super().__init__()
        experts = experts or ExpertsChoice("grouped", keep_fp8=False)
        self.cfg, self.dtype = cfg, dtype
        self.shard, self.dispatcher = shard, dispatcher
        self.placement = None  # eplb.Placement of the routed experts, set by build.load_model
        self.cpu_kernels = experts.backend == "cpu"  # also the projections and lm_head (cpu/linear.py)
        self.huge_page_bytes = 0                     # weights in 2 MiB pages (cpu/huge_pages.py; build.py)
        self.backends = {"experts": "torch" if experts.backend == "grouped" else experts.backend,
                         "fp8_weights": fp8_block is not None, "attention": attention}
        self.rope = RotaryEmbedding(cfg.mla.rope, device=device)
        # Built on the meta device and materialised empty: the checkpoint fills every parameter,
        # and random init of a 671B model would take longer than loading it. Init is skipped even on
        # meta: its first random op imports torch._dynamo (~2.5 s per process, every rank).
        with torch.device("meta"), _skip_init():
            self.model = _Inner(cfg, self.rope, shard, experts, attention, dtype=dtype, fp8_block=fp8_block,
                                kv_cache_dtype=kv_cache_dtype)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                            dtype=dtype)
        _materialize(self, device)
        for layer in self.model.layers:
            if layer.is_moe:  # the router keeps fp32 whatever the model dtype, as the checkpoints do
                layer.mlp.gate.float()
        self.step_ops = [self.op_embed, *(op for layer in self.model.layers for op in layer.ops()), self.op_final_norm]
        # a plain step's list: the same operations, an MoE half on the C backend as one (DecoderLayer.fused_ops),
        # and on CPU decode steps every layer in one call when each can be (op_layers)
        self.layer_ops = [op for layer in self.model.layers for op in layer.fused_ops()]
        self.plain_ops = [self.op_embed, self.op_layers, self.op_final_norm]
        self.fuse_decode_stack = self.cpu_kernels   # op_layers may run the whole stack as one C call

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> destination tensor (a view for stacked experts)."""
        targets: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if ".mlp.experts.w" not in name:
                targets[name] = p.data
        for i, layer in enumerate(self.model.layers):
            if not layer.is_moe:
                continue
            for slot, e in enumerate(layer.mlp.local_phy2log):
                if f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" in targets:
                    continue  # a second local replica: copy_local_replicas() fills it after loading
                targets.update(expert_targets(layer.mlp.experts, i, e, slot))
        return targets

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers in order (EPLB's layer index l is the position in this list)."""
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    @torch.no_grad()
    def copy_local_replicas(self) -> None:
        """Slots holding an expert this rank already holds in an earlier slot (one EP rank with
        redundant slots) get that slot's weights; checkpoint_targets loads only the first."""
        for moe in self.moe_layers():
            first: dict[int, int] = {}
            for slot, e in enumerate(moe.local_phy2log):
                if e in first:
                    for p in moe.experts.parameters():
                        p.data[slot] = p.data[first[e]]
                first.setdefault(e, slot)

    def owns_expert(self, layer: int, expert: int) -> bool:
        """Whether this rank loads logical `expert` of `layer` (the loader skips the others unread)."""
        mlp = self.model.layers[layer].mlp if layer < len(self.model.layers) else None
        return isinstance(mlp, MoELayer) and expert in mlp.local_phy2log

    def param_bytes(self) -> dict[str, int]:
        """Bytes of this rank's parameters: total and routed experts."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        experts = sum(p.numel() * p.element_size() for n, p in self.named_parameters() if ".mlp.experts." in n)
        return {"total": total, "experts": experts}

    # -- the operations at the ends of the list ---------------------------------------------------
    def op_embed(self, s: OpState) -> None:
        mb = s.inputs
        max_pos = max(mb.meta.ctx_lens) - 1 if mb.meta.ctx_lens else 0
        s.put(x=self.model.embed_tokens(mb.input_ids), rope=self.rope.cos_sin(mb.meta.positions, max_position=max_pos))

    def op_layers(self, s: OpState) -> None:
        """Every decoder layer. On a decode step where each layer can (a plain step on the C kernels, every
        token the only query of its sequence, at most cpu.linear.MAX_ROWS of them, no per-layer hook,
        every layer's attention and MoE or MLP half fusable: DecoderLayer.fused), one C call runs them
        all (cpu/fused.py decode_stack: the calls the layers' fused halves make, in order), and the MoE
        layers' counters are recorded as those halves record them. Checking every layer before the
        call, not between layers, is the point: Python run between two layers' weight streams finds
        the caches emptied by them and costs ~10x. Otherwise the layers' operations (layer_ops)."""
        mb = s.inputs
        if self.fuse_decode_stack and mb.on_layer is None and mb.index_pools is None:
            x, (cos, sin) = s.peek("x"), s.peek("rope")
            out = self._decode_stack(mb, x, cos, sin)
            if out is not None:
                s.take("x")
                s.put(x=out)
                return
        run_sequential(self.layer_ops, s)

    def _decode_stack(self, mb: Microbatch, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        from cpu.linear import MAX_ROWS
        layers, meta = self.model.layers, mb.meta
        attn = layers[0].self_attn
        from cpu.fused import f32_rows
        tables = meta.decode_tables(attn.mode, cos, sin, attn.cfg.qk_rope_head_dim, MAX_ROWS)
        if tables is None or not f32_rows(x, cos.shape[0], self.cfg.hidden_size):
            return None
        parts = [layer.fused(mb) for layer in layers]
        if any(p is None for p in parts):
            return None
        from ctypes import addressof
        from cpu.fused import LayerDesc, decode_stack
        descs = (LayerDesc * len(parts))()
        for d, layer, (a, m, dense), pool in zip(descs, layers, parts, mb.kv_pools):
            lc = layer.mlp.load_counts if m is not None else None
            d.mla, d.wuk_t = addressof(a), layer.self_attn.w_uk_t().data_ptr()
            d.pool, d.S = pool.data_ptr(), pool.shape[0]
            d.moe = addressof(m) if m is not None else None
            d.mlp = addressof(dense) if dense is not None else None
            d.load = lc.data_ptr() if lc is not None else None
        table, lens, max_len = tables
        out, ids, wts = decode_stack(x, descs, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                                     cos, sin, meta.slot_mapping, table, lens, max_len, meta.block_size)
        if ids.shape[0]:
            mb.dispatcher.account_local(x.shape[0], layers=ids.shape[0])
        return out

    def op_final_norm(self, s: OpState) -> None:
        """Leaves "hidden" [T, H], the final-normed hidden states (OpState.result)."""
        s.take("rope")
        s.put(hidden=self.model.norm(s.take("x")))

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, kv_pools: list[torch.Tensor], plan: StepPlan,
                on_layer=None, index_pools: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H], `plain_ops` in order. plan: the step's
        (parallel.StepPlan, the same on every rank; the dispatcher takes its mode from it).
        on_layer(i), when given, runs as soon as layer i's latents are in kv_pools[i] (right after
        its attention): disaggregation starts that layer's KV transfer. index_pools: DSA's indexer-key
        pools (LatentKVPool.index_pools), None for models without."""
        s = OpState(Microbatch(0, input_ids, meta, kv_pools, plan, self.dispatcher, on_layer, index_pools))
        return run_sequential(self.plain_ops, s).result("hidden")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, V] fp32."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (small_linear(hidden, w) if self.cpu_kernels else hidden @ w.t()).float()
