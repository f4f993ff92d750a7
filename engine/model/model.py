"""DeepSeek-V2/V3/V3.2-class decoder (GLM-4.x-MoE-lite and Kimi-K2.5's text model too) assembled from
wideep's MLA (SparseMLA for V3.2's DeepSeek Sparse Attention) and MoE modules.

Legend: T tokens in the step (all sequences flattened), H hidden, V vocab.
Parameter names follow the HF checkpoint, so `checkpoint_targets` is mostly the identity; routed
experts are stacked per layer (w13 [El, 2I, H], w2 [El, H, I]) and the checkpoint's
per-expert tensors are views into them. With `fp8_block` the routed experts and the attention/MLP
projections keep the fp8 checkpoint's values and block scales (`*_scale_inv` become targets too), computed
on by the backend's fp8 kernels (Triton on the GPU, the C GEMM of the CPU kernel table: kernels.fp8_linear);
kv_b_proj, norms, router, embeddings and lm_head are dequantised / high precision as usual.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from wideep.attention_mla.meta import AttnMeta
from wideep.attention_mla.mla import MLA
from wideep.attention_mla.rope import RotaryEmbedding
from wideep.attention_mla.sparse_mla import SparseMLA
from wideep.dbo.schedule import YIELD
from wideep.dbo.state import Microbatch, OpState
from wideep.layers import MLP, NATIVE, Kernels, RMSNorm
from wideep.moe.backend import ExpertsChoice
from wideep.moe.fp8_linear import Fp8Linear
from wideep.moe.layer import ExpertShard, MoELayer
from wideep.parallel.expert_routing import ExpertRouting
from wideep.parallel.step_plan import StepPlan

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
    from wideep.cpu.huge_pages import advise
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = torch.empty(t.shape, dtype=t.dtype, device=device)
                if new.device.type == "cpu":   # before the loader first touches it: faults in 2 MiB pages
                    advise([new])
                table[name] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


class DecoderLayer(nn.Module):
    """norm -> MLA -> + residual -> norm -> dense MLP | MoE -> + residual, as operations on an OpState
    (dbo/state.py) that holds "x" [T, H] and "rope" (cos, sin [T, R/2]) between layers."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, shard: ExpertShard | None,
                 experts: ExpertsChoice, attention: str, device=None, dtype=None, fp8_block=None,
                 kv_cache_dtype: str = "auto", kernels: Kernels = NATIVE, routing=None, moe: bool | None = None):
        """routing: this layer's view of the model's ExpertRouting (parallel/expert_routing.py), MoE layers.
        moe: whether the MLP is the MoE (None: as cfg says for `layer`; an MTP layer past the stack says it itself)."""
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        linear = Fp8Linear.factory(fp8_block, kernel=kernels.fp8_linear) if fp8_block is not None else kernels.linear
        self.index = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels=kernels, **kw)
        kw_attn = dict(kw, linear=linear, backend=attention, kv_cache_dtype=kv_cache_dtype, kernels=kernels)
        self.self_attn = (MLA(cfg.mla, rope, **kw_attn) if cfg.dsa is None
                          else SparseMLA(cfg.mla, cfg.dsa, rope, **kw_attn))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels=kernels, **kw)
        self.is_moe = cfg.is_moe_layer(layer) if moe is None else moe
        if self.is_moe and cfg.moe is None:
            raise ValueError(f"decoder layer {layer} is a MoE layer, but the config has no routed experts "
                             f"(n_routed_experts null)")
        self.mlp = (MoELayer(cfg.moe, shard, fp8_block=fp8_block, linear=linear, experts_backend=experts.backend,
                             deepgemm=experts.deepgemm, kernels=kernels, routing=routing, **kw) if self.is_moe
                    else MLP(cfg.hidden_size, cfg.intermediate_size, linear=linear, **kw))

    def ops(self) -> list:
        """attention, kv_written (on_layer), the MLP's or MoE's operations (moe/layer.py), residual."""
        return [self.op_attention, self.op_kv_written, *self.mlp_ops()]

    def mlp_ops(self) -> list:
        """The operations after attention: the MoE's (moe/layer.py) or the dense MLP, then the residual."""
        return [*(self.mlp.ops() if self.is_moe else [self.op_dense_mlp]), self.op_residual]

    def op_attention(self, s: OpState) -> None:
        mb, x = s.inputs, s.take("x")
        cos, sin = s.peek("rope")
        # DSA layers also write and read their indexer keys (the same slots in index_pools)
        extra = {} if mb.index_pools is None else {"index_pool": mb.index_pools[self.index]}
        h = x + self.self_attn(self.input_layernorm(x), mb.meta, mb.kv_pools[self.index], cos, sin, **extra)
        s.put(h=h, mlp_in=self.post_attention_layernorm(h))

    def op_kv_written(self, s: OpState) -> None:
        """This layer's latents are in kv_pools[index]: disaggregation may start sending them."""
        if s.inputs.on_layer is not None:
            s.inputs.on_layer(self.index)

    def op_dense_mlp(self, s: OpState) -> None:
        s.put(mlp_out=self.mlp(s.take("mlp_in")))

    def op_residual(self, s: OpState) -> None:
        s.put(x=s.take("h") + s.take("mlp_out"))
        s.end_layer(self.index, CARRY)


class DecoderStack(nn.Module):
    """The checkpoint's `model.*`: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, shard, experts: ExpertsChoice, attention: str,
                 device=None, dtype=None, fp8_block=None, kv_cache_dtype: str = "auto", kernels: Kernels = NATIVE,
                 routing: ExpertRouting | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        moe_index = {i: m for m, i in enumerate(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))}
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope, shard, experts, attention, device, dtype, fp8_block,
                                                 kv_cache_dtype, kernels,
                                                 routing.layers[moe_index[i]] if routing and i in moe_index else None)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype, kernels=kernels)


class DeepseekModel(nn.Module):
    """`shard` (this rank's experts) and `dispatcher` (parallel.dispatch; LocalDispatcher on one EP
    rank) serve the MoE layers; attention, dense layers, shared experts, embeddings and lm_head are
    replicated on every rank. `experts` and `attention` are the resolved backends (moe/backend.py,
    attention_mla/paged_decode.py) and `kernels` the backend's per-op kernels (layers/kernels.py),
    given to the modules when they are built.

    The forward is `step_ops` (dbo/schedule.py): embed, every layer's operations, final norm, on an
    OpState per microbatch (dbo/state.py); forward() runs them in order, dbo.overlap.Overlap runs two
    microbatches through them. `decode_plan` (a factory of the backend's fast path, given by the
    builder; the CPU one is fused_decode.py) may hand a plain step other operations that run the
    same kernels fused: it decides once per step, from the step's inputs, and counts why when it
    does not."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 shard: ExpertShard | None = None, dispatcher=None, fp8_block: tuple[int, int] | None = None,
                 experts: ExpertsChoice | None = None, attention: str = "torch", kv_cache_dtype: str = "auto",
                 kernels: Kernels = NATIVE, decode_plan=None, placement=None):
        """placement: the routed experts' (eplb.placement.Placement), installed into the routing the MoE layers read;
        None: the identity. dispatcher: None until the engine wires one (use_dispatcher)."""
        super().__init__()
        experts = experts or ExpertsChoice("grouped", keep_fp8=False)
        self.cfg, self.dtype, self.kernels = cfg, dtype, kernels
        # how the layers were built: an MTP drafter's layer (engine/model/mtp.py) is built the same way
        self.layer_options = dict(experts=experts, attention=attention, fp8_block=fp8_block, kv_cache_dtype=kv_cache_dtype)
        self.shard, self.dispatcher = shard, dispatcher
        # the routed experts' placement and load counters as the MoE layers read them, updated in place by
        # EPLB and by re-forming after a lost rank (parallel/expert_routing.py)
        self.routing = None
        if cfg.moe is not None:
            sh = shard or ExpertShard(cfg.moe.n_routed_experts)
            num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
            self.routing = ExpertRouting(num_moe, list(sh.layout.slots(sh.ep_rank)))
        self.huge_page_bytes = 0                     # weights in 2 MiB pages (cpu/huge_pages.py; in_huge_pages)
        self.load_report = None                      # loader.LoadReport, once loaded()
        # "decode": the path the last plain step took (the decode plan's, or "ops")
        self.backends = {"experts": "torch" if experts.backend == "grouped" else experts.backend,
                         "fp8_weights": fp8_block is not None, "attention": attention, "kernels": kernels.name,
                         "decode": "ops"}
        self.rope = RotaryEmbedding(cfg.mla.rope, device=device, kernels=kernels)
        # Built on the meta device and materialised empty: the checkpoint fills every parameter,
        # and random init of a 671B model would take longer than loading it. Init is skipped even on
        # meta: its first random op imports torch._dynamo (~2.5 s per process, every rank).
        with torch.device("meta"), _skip_init():
            self.model = DecoderStack(cfg, self.rope, shard, experts, attention, dtype=dtype, fp8_block=fp8_block,
                                      kv_cache_dtype=kv_cache_dtype, kernels=kernels, routing=self.routing)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                            dtype=dtype)
        _materialize(self, device)
        for layer in self.model.layers:
            if layer.is_moe:  # the router keeps fp32 whatever the model dtype, as the checkpoints do
                layer.mlp.gate.float()
        if placement is not None:
            sh = shard or ExpertShard(placement.num_physical)
            placement.install(self.routing, sh.ep_rank, sh.ep_size, self.device)
        self.step_ops = [self.op_embed, *(op for layer in self.model.layers for op in layer.ops()), self.op_final_norm]
        self.decode_plan = decode_plan(self) if decode_plan is not None else None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def placement(self):
        """The routed experts' eplb.placement.Placement as installed last (by the builder, EPLB or recovery), or
        None for a model without routed experts."""
        return self.routing.placement if self.routing is not None else None

    def use_dispatcher(self, dispatcher) -> None:
        """The MoE layers' all-to-all from now on (the engine wires one per parallel context: at start-up and after
        the ranks re-form)."""
        self.dispatcher = dispatcher

    def use_shard(self, shard: ExpertShard | None) -> None:
        """This rank's slice of the physical experts after a re-layout (each MoE layer took its own:
        MoELayer.use_experts)."""
        self.shard = shard

    def loaded(self, report) -> None:
        """The checkpoint is in (loader.LoadReport: what was read and skipped)."""
        self.load_report = report

    def in_huge_pages(self, nbytes: int) -> None:
        """nbytes of the weights (the MTP layer's included) now sit in 2 MiB pages (cpu/huge_pages.py)."""
        self.huge_page_bytes = nbytes

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
            moe.copy_local_replicas()

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

    def op_final_norm(self, s: OpState) -> None:
        """Leaves "hidden" [T, H], the final-normed hidden states (OpState.result)."""
        s.take("rope")
        s.put(hidden=self.model.norm(s.take("x")))

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, kv_pools: list[torch.Tensor], plan: StepPlan,
                on_layer=None, index_pools: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H]: step_ops in order, or the decode plan's. plan: the step's
        (parallel.StepPlan, the same on every rank; the dispatcher takes its mode from it).
        on_layer(i), when given, runs as soon as layer i's latents are in kv_pools[i] (right after
        its attention): disaggregation starts that layer's KV transfer. index_pools: DSA's indexer-key
        pools (LatentKVPool.index_pools), None for models without."""
        if self.dispatcher is None and self.routing is not None:
            sh = self.shard
            raise RuntimeError(f"this model's MoE layers have no dispatcher (EP rank {sh.ep_rank if sh else 0} of "
                               f"{sh.ep_size if sh else 1}): the engine wires its EP group's (use_dispatcher)")
        mb = Microbatch(0, input_ids, meta, kv_pools, plan, self.dispatcher, on_layer, index_pools)
        ops = self.step_ops if self.decode_plan is None else self.decode_plan.ops_for(mb)
        s = OpState(mb)
        for op in ops:
            if op is not YIELD:
                op(s)
        return s.result("hidden")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, V] fp32."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (hidden @ w.t() if self.kernels.matmul is None else self.kernels.matmul(hidden, w)).float()
