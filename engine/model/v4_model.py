"""DeepSeek-V4 decoder assembled from attention_v4/ (sliding / CSA / HCA attention), layers/ (RMSNorm,
hyper-connections) and moe/ (sqrtsoftplus or hash-routed MoE with clamped SwiGLU, through the dispatcher).

Legend: T tokens in the step (sequences flattened), n hc_mult, H hidden, V vocab.
Per layer, on n residual streams x [T, n, H]:
    attention:  pre, post, comb = hc_attn(x);  x = post * attn(attn_norm(collapse(x, pre))) + comb^T x
    MoE:        pre, post, comb = hc_ffn(x);   x = post * moe(ffn_norm(collapse(x, pre))) + comb^T x
then  hidden = norm(hc_head(x)),  logits = head(hidden). The embedding starts all n streams equal.
Every layer is MoE; hash layers route by the token ids, which travel in the microbatch (dbo/state.py).

Parameter names are DeepSeek's checkpoint names (embed, layers.i.attn.wq_a, ffn.experts.e.w1, ...), except the
hyper-connections' (layers.i.hc_attn.fn for hc_attn_fn), the gate bias (gate.e_score_correction_bias for
gate.bias) and the stacked experts: `checkpoint_targets` maps them.
"""
from __future__ import annotations

import torch
from torch import nn

from wideep.attention_mla.rope import RotaryEmbedding
from wideep.attention_v4 import decode
from wideep.attention_v4.attention import V4Attention
from wideep.attention_v4.streams import SequenceStreams, V4Meta
from wideep.dbo.schedule import YIELD
from wideep.dbo.state import Microbatch, OpState
from wideep.layers import NATIVE, Kernels, RMSNorm
from wideep.layers.hyper_connection import HyperConnection, HyperHead
from wideep.moe.backend import ExpertsChoice
from wideep.moe.fp8_linear import Fp8Linear
from wideep.moe.layer import ExpertShard, MoELayer
from wideep.parallel.expert_routing import ExpertRouting
from wideep.parallel.step_plan import StepPlan

from .model import _materialize, _skip_init
from .model_config import ModelConfig

CARRY = ("x",)   # what one layer hands the next: the residual streams [T, n, H]


def v4_expert_targets(experts, prefix: str, expert: int, slot: int) -> dict[str, torch.Tensor]:
    """Checkpoint names of logical `expert` of the block named `prefix` ("layers.3." or "mtp.0.") -> views into local
    `slot` of `experts`: w1 (gate) and w3 (up) rows of w13, w2, and with FP4 weights their e8m0 scales, as stored."""
    I, pre = experts.intermediate, f"{prefix}ffn.experts.{expert}."
    out = {pre + "w1.weight": experts.w13.data[slot, :I], pre + "w3.weight": experts.w13.data[slot, I:],
           pre + "w2.weight": experts.w2.data[slot]}
    if experts.fp4:   # the packed pairs above and their e8m0 bytes
        s13, s2 = experts.w13_scale_inv.data, experts.w2_scale_inv.data
        out |= {pre + "w1.weight_scale_inv": s13[slot, :I], pre + "w3.weight_scale_inv": s13[slot, I:],
                pre + "w2.weight_scale_inv": s2[slot]}
    return out


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: dict[str, RotaryEmbedding], shard, experts: ExpertsChoice,
                 routing, device=None, dtype=None, kind: str | None = None, hash_moe: bool | None = None,
                 kernels: Kernels = NATIVE, fp8_block: tuple[int, int] | None = None):
        """kind / hash_moe: the attention kind and hash routing, by default the config's for `layer`. kernels:
        the backend's table (layers/kernels.py; no route kernel: V4's gates are sqrtsoftplus or hash): its
        linear class for the attention's and shared expert's projections, its rmsnorm, its experts kernel when
        experts.backend is "cpu". fp8_block: the attention's five projections and the shared expert's keep FP8 weights
        in these blocks (moe/fp8_linear.py, read by kernels.fp8_linear), as DeepSeek stores them."""
        super().__init__()
        linear = kernels.linear if fp8_block is None else Fp8Linear.factory(fp8_block, kernel=kernels.fp8_linear)
        v4, H = cfg.v4, cfg.hidden_size
        self.index, self.kind = layer, v4.layer_kinds[layer] if kind is None else kind
        hash_moe = v4.hash_layers[layer] if hash_moe is None else hash_moe
        hc = dict(n=v4.hc_mult, sinkhorn_iters=v4.hc_sinkhorn_iters, eps=v4.hc_eps, norm_eps=cfg.rms_norm_eps,
                  device=device, kernels=kernels)
        self.hc_attn, self.hc_ffn = HyperConnection(H, **hc), HyperConnection(H, **hc)
        self.attn_norm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype, kernels=kernels)
        self.attn = V4Attention(v4.attention, self.kind, rope["main" if self.kind == "sliding" else "compress"],
                                device=device, dtype=dtype, linear=linear, kernels=kernels, side_linear=kernels.linear)
        self.ffn_norm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype, kernels=kernels)
        self.ffn = MoELayer(cfg.moe, shard, device=device, dtype=dtype, experts_backend=experts.backend,
                            routing=routing, hash_vocab=cfg.vocab_size if hash_moe else None, kernels=kernels,
                            fp4_experts=experts.keep_fp4, linear=linear)

    def ops(self) -> list:
        return [self.op_attention, self.op_kv_written, *self.ffn.ops(), self.op_residual]

    def op_kv_written(self, s: OpState) -> None:
        """This layer's streams hold the step's tokens: disaggregation may start sending them."""
        if s.inputs.on_layer is not None:
            s.inputs.on_layer(self.index)

    def op_attention(self, s: OpState) -> None:
        x = s.take("x")
        y, post, comb = self.hc_attn.enter(x)
        x = self.hc_attn.leave(x, self.attn(self.attn_norm(y), s.inputs.meta, self.index), post, comb)
        y, post, comb = self.hc_ffn.enter(x)
        s.put(streams=x, hc_post=post, hc_comb=comb, mlp_in=self.ffn_norm(y))

    def op_residual(self, s: OpState) -> None:
        s.put(x=self.hc_ffn.leave(s.take("streams"), s.take("mlp_out"), s.take("hc_post"), s.take("hc_comb")))
        s.end_layer(self.index, CARRY)


# -- multi-token prediction ---------------------------------------------------------------------------------
# DeepSeek-V4's multi-token-prediction (MTP) blocks, loaded with the model and not run by its forward: the
# speculative-decoding work drives them. Checkpoint names `mtp.{k}.*` (DeepSeek's; transformers 5.24 has no MTP
# module and drops them on load).
#
# Legend: T tokens, n hc_mult, H hidden. Block k is a full V4 decoder layer (attention, hyper-connections, MoE with
# one shared expert; never hash-routed; its attention kind from compress_ratios past the L layers, sliding-window by
# default) plus what turns the main model's streams and the next token into its input and its output into logits:
#     x [T, n, H] = e_proj(enorm(embed(next_ids)))[:, None] + h_proj(hnorm(streams))     (streams: the main model's)
#     x = layer(x);   logits = head(norm(hc_head(x)))
# embed and head are the main model's (shared, not stored in the block).


class V4MTPBlock(V4DecoderLayer):
    """A V4 decoder layer with the MTP input projections e_proj / h_proj [H, H], their norms enorm / hnorm [H], and
    its own output head: hc_head (HyperHead) and norm [H]. `index` is L + k (the layer after the main stack)."""

    def __init__(self, cfg, k: int, rope, shard, experts, routing, device=None, dtype=None, kernels=NATIVE,
                 fp8_block=None):
        v4, H = cfg.v4, cfg.hidden_size
        super().__init__(cfg, cfg.num_hidden_layers + k, rope, shard, experts, routing, device=device, dtype=dtype,
                         kind=v4.mtp_layer_kinds[k], hash_moe=False, kernels=kernels, fp8_block=fp8_block)
        self.e_proj = kernels.linear(H, H, bias=False, device=device, dtype=dtype)
        self.h_proj = kernels.linear(H, H, bias=False, device=device, dtype=dtype)
        self.enorm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype, kernels=kernels)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype, kernels=kernels)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, device=device, dtype=dtype, kernels=kernels)
        self.hc_head = HyperHead(H, v4.hc_mult, v4.hc_eps, cfg.rms_norm_eps, device=device, kernels=kernels)


class DeepseekV4Model(nn.Module):
    """One rank's DeepSeek-V4: `shard` (this rank's experts) and `dispatcher` serve the MoE layers as in
    engine/model/model.py; everything else is replicated. The forward is `step_ops` on an OpState per
    microbatch; the attention's per-sequence streams come in the step's V4Meta (attention_v4/streams.py).
    num_mtp: how many multi-token-prediction blocks (V4MTPBlock below) to hold in `mtp`, loaded with the rest
    and never run by the forward; at most the config's num_nextn_predict_layers.
    experts: the routed experts' forward: torch ("grouped" / "reference") or "cpu" (the C experts kernel, clamped
    SwiGLU included; kernels: a table with that kernel), with keep_fp4 the FP4 weights as stored. kernels: the
    backend's table (layers/kernels.py: linears, norms, the head's matmul, the experts; route None).
    batched_decode: a decode step's attention runs as one batch (attention_v4/decode.py; False: one sequence at a
    time, the reference). fp8_block: the attention's and shared experts' projections keep FP8 weights (DeepSeek's
    format: e4m3 in these blocks, a float32 scale each), read by kernels.fp8_linear (needs one)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 shard: ExpertShard | None = None, dispatcher=None, experts: ExpertsChoice | None = None,
                 num_mtp: int = 0, kernels: Kernels = NATIVE, placement=None, with_streams: bool = False,
                 batched_decode: bool = True, fp8_block: tuple[int, int] | None = None):
        """placement: the routed experts' (eplb.placement.Placement, [L, P]; None: the initial one), installed into
        the routing the decoder layers read; the MTP blocks take the initial placement. with_streams: forward's rows
        carry their residual streams after the hidden state (the MTP drafter's input)."""
        super().__init__()
        if cfg.v4 is None:
            raise ValueError(f"DeepseekV4Model needs a DeepSeek-V4 config, got arch {cfg.arch!r}")
        if not 0 <= num_mtp <= cfg.num_nextn_predict_layers:
            raise ValueError(f"num_mtp {num_mtp} MTP blocks, but the config's num_nextn_predict_layers is "
                             f"{cfg.num_nextn_predict_layers}")
        experts = experts or ExpertsChoice("grouped", keep_fp8=False)
        if experts.backend not in ("grouped", "reference", "cpu") or experts.keep_fp8:
            raise ValueError(f"DeepSeek-V4 runs its experts on the torch or cpu backend (clamped SwiGLU), "
                             f"not {experts.backend!r}{' with fp8 weights' if experts.keep_fp8 else ''}")
        if experts.keep_fp4 and experts.backend != "cpu":
            raise ValueError(f"DeepSeek-V4's FP4 experts are read as stored by the cpu experts kernel only, not "
                             f"{experts.backend!r}")
        if fp8_block is not None and kernels.fp8_linear is None:
            raise ValueError("DeepSeek-V4 with FP8 projections needs a kernel table with fp8_linear (the cpu one)")
        if kernels.route is not None:
            raise ValueError("DeepSeek-V4's gates (sqrtsoftplus, hash) take no route kernel: pass a table without one")
        self.cfg, self.dtype, self.shard, self.dispatcher, self.kernels = cfg, dtype, shard, dispatcher, kernels
        sh = shard or ExpertShard(cfg.moe.n_routed_experts)
        self.routing = ExpertRouting(cfg.num_hidden_layers, list(sh.layout.slots(sh.ep_rank)))
        # the MTP blocks keep the initial placement (slot p holds expert p % E; eplb.Placement.initial), no EPLB
        self.mtp_routing = ExpertRouting(num_mtp, [p % cfg.moe.n_routed_experts for p in sh.layout.slots(sh.ep_rank)])
        self.backends = {"experts": "cpu" if experts.backend == "cpu" else "torch",
                         "fp8_weights": fp8_block is not None,
                         "fp4_experts": experts.keep_fp4,
                         "attention": "batched_decode" if batched_decode else "torch", "kernels": kernels.name,
                         "decode": "batched" if batched_decode else "ops"}
        att = cfg.v4.attention
        self.rope = {"main": RotaryEmbedding(att.rope_main, device=device),
                     "compress": RotaryEmbedding(att.rope_compress, device=device)}
        H, n = cfg.hidden_size, cfg.v4.hc_mult
        with torch.device("meta"), _skip_init():
            self.embed = nn.Embedding(cfg.vocab_size, H, dtype=dtype)
            self.layers = nn.ModuleList(V4DecoderLayer(cfg, i, self.rope, shard, experts, self.routing.layers[i],
                                                       dtype=dtype, kernels=kernels, fp8_block=fp8_block)
                                        for i in range(cfg.num_hidden_layers))
            self.hc_head = HyperHead(H, n, cfg.v4.hc_eps, cfg.rms_norm_eps, kernels=kernels)
            self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
            self.head = None if cfg.tie_word_embeddings else nn.Linear(H, cfg.vocab_size, bias=False, dtype=dtype)
            self.mtp = nn.ModuleList(V4MTPBlock(cfg, k, self.rope, shard, experts, self.mtp_routing.layers[k],
                                                dtype=dtype, kernels=kernels, fp8_block=fp8_block)
                                     for k in range(num_mtp))
        _materialize(self, device)
        for layer in [*self.layers, *self.mtp]:   # the router keeps fp32 whatever the model dtype
            layer.ffn.gate.float()
            layer.attn.batched_decode = batched_decode
        if dispatcher is None and sh.ep_size == 1:   # one process, every expert local (else: the engine wires one)
            from wideep.parallel.context import ParallelContext
            from wideep.parallel.dispatch import LocalDispatcher
            self.dispatcher = LocalDispatcher(ParallelContext.single(device), sh.num_physical, cfg.hidden_size)
        from wideep.eplb.placement import Placement
        E, P = cfg.moe.n_routed_experts, sh.num_physical
        (placement or Placement.initial(cfg.num_hidden_layers, E, P)).install(self.routing, sh.ep_rank, sh.ep_size,
                                                                              self.device)
        if num_mtp:   # their own initial placement, which EPLB leaves alone
            Placement.initial(num_mtp, E, P).install(self.mtp_routing, sh.ep_rank, sh.ep_size, self.device)
        self.step_ops = [self.op_embed, *(op for layer in self.layers for op in layer.ops()), self.op_final_norm]
        self.with_streams = with_streams
        self.load_report = None   # loader.LoadReport, once loaded()
        self.decode_plan = None   # the MLA family's fused CPU decode does not take V4 layers (fused_decode.py)
        # V4's own: decode steps batched (attention_v4/decode.py), counted in the engine's decode_steps_v4_batched;
        # the reference (batched_decode off) says why it has no fast path: its decode steps counted as declined
        self.step_paths = {"v4_batched": 0} if batched_decode else {}
        self.decode_plan_declined = "deepseek_v4_layers" if self.device.type == "cpu" and not batched_decode else None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def placement(self):
        """The decoder layers' eplb.placement.Placement as installed last (builder, EPLB, recovery)."""
        return self.routing.placement

    def use_dispatcher(self, dispatcher) -> None:
        """The MoE layers' all-to-all from now on (wired by the engine per parallel context)."""
        self.dispatcher = dispatcher

    def use_shard(self, shard: ExpertShard | None) -> None:
        """This rank's slice of the physical experts after a re-layout."""
        self.shard = shard

    def new_streams(self) -> SequenceStreams:
        """An empty sequence's streams, every layer's."""
        return SequenceStreams.empty(self.cfg.v4.attention, self.cfg.v4.layer_kinds, self.device, self.dtype)

    # -- checkpoint ----------------------------------------------------------------------------------
    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """DeepSeek checkpoint name -> destination tensor (a view for stacked experts)."""
        targets: dict[str, torch.Tensor] = {}
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if ".ffn.experts.w" in name:
                continue
            for ours, theirs in ((".hc_attn.", ".hc_attn_"), (".hc_ffn.", ".hc_ffn_"), ("hc_head.", "hc_head_"),
                                 (".gate.e_score_correction_bias", ".gate.bias")):
                name = name.replace(ours, theirs)
            targets[name] = t.data
        blocks = [(f"layers.{i}.", layer) for i, layer in enumerate(self.layers)]
        blocks += [(f"mtp.{k}.", block) for k, block in enumerate(self.mtp)]
        for prefix, layer in blocks:
            for slot, e in enumerate(layer.ffn.local_phy2log):
                if f"{prefix}ffn.experts.{e}.w2.weight" in targets:
                    continue   # a second local replica: copy_local_replicas fills it
                targets |= v4_expert_targets(layer.ffn.experts, prefix, e, slot)
        for prefix, _ in blocks:   # the shared expert: w1 / w3 / w2 as DeepSeek names them
            for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                for suffix in (".weight", ".weight_scale_inv"):   # (the scale: FP8 weights, fp8_block)
                    t = targets.pop(f"{prefix}ffn.shared_experts.{ours}{suffix}", None)
                    if t is not None:
                        targets[f"{prefix}ffn.shared_experts.{theirs}{suffix}"] = t
        return targets

    def loaded(self, report) -> None:
        """The checkpoint is in (loader.LoadReport: what was read and skipped)."""
        self.load_report = report

    def owns_expert(self, layer: int, expert: int) -> bool:
        """layer: a decoder layer, or L + k for MTP block k; expert: logical id."""
        L = len(self.layers)
        block = self.layers[layer] if layer < L else self.mtp[layer - L] if layer < L + len(self.mtp) else None
        return block is not None and expert in block.ffn.local_phy2log

    def moe_layers(self) -> list[MoELayer]:
        return [layer.ffn for layer in self.layers]

    @torch.no_grad()
    def copy_local_replicas(self) -> None:
        for moe in [*self.moe_layers(), *(block.ffn for block in self.mtp)]:
            moe.copy_local_replicas()

    def param_bytes(self) -> dict[str, int]:
        """total: every parameter held; experts: the decoder layers' routed experts; mtp: the MTP blocks' (all of
        theirs, experts included; part of total)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        experts = sum(p.numel() * p.element_size() for n, p in self.named_parameters()
                      if n.startswith("layers.") and ".ffn.experts." in n)
        mtp = sum(p.numel() * p.element_size() for p in self.mtp.parameters())
        return {"total": total, "experts": experts, "mtp": mtp}

    def mtp_num_params(self) -> int:
        """Parameters of the MTP blocks (not counted by the forward's layers)."""
        return sum(p.numel() for p in self.mtp.parameters())

    # -- forward -------------------------------------------------------------------------------------
    def op_embed(self, s: OpState) -> None:
        e = self.embed(s.inputs.input_ids)                                      # [T, H]
        s.put(x=e[:, None, :].expand(-1, self.cfg.v4.hc_mult, -1).contiguous())

    def op_final_norm(self, s: OpState) -> None:
        x = s.take("x")
        hidden = self.norm(self.hc_head(x))
        if self.with_streams:   # the MTP drafter's input: each row's residual streams after the hidden state
            hidden = torch.cat([hidden, x.flatten(1)], dim=1)
        s.put(hidden=hidden)

    def forward(self, input_ids: torch.Tensor, meta: V4Meta, kv_pools=(), plan: StepPlan = StepPlan(), on_layer=None,
                index_pools=None) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H]. meta: the step's sequences and their streams,
        which take the new tokens (num_tokens advances). The streams are the cache: kv_pools / index_pools (the
        MLA models' pools, as the runner passes them) must be empty. on_layer(i) (disaggregation): called once layer
        i's streams hold the step's tokens."""
        if kv_pools or index_pools:
            raise ValueError("DeepSeek-V4 keeps its KV in the streams of meta: no pools")
        if self.dispatcher is None:
            raise RuntimeError(f"this DeepSeek-V4 model holds {self.shard.num_local} of {self.shard.num_physical} "
                               f"expert slots (EP rank {self.shard.ep_rank} of {self.shard.ep_size}) and no dispatcher: "
                               f"the engine wires its EP group's (use_dispatcher)")
        if input_ids.shape[0] != sum(meta.lens):
            raise ValueError(f"{input_ids.shape[0]} tokens for chunks of {sum(meta.lens)}")
        if self.step_paths and decode.batchable(meta, 0):
            self.step_paths["v4_batched"] += 1
        s = OpState(Microbatch(0, input_ids, meta, [], plan, self.dispatcher, on_layer))
        for op in self.step_ops:
            if op is not YIELD:
                op(s)
        for seq, n in zip(meta.streams, meta.lens):
            seq.num_tokens += n
        return s.result("hidden")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] (or forward's rows with_streams: their first H columns) -> logits [n, V] fp32."""
        w, h = self.embed.weight if self.head is None else self.head.weight, hidden[:, :self.cfg.hidden_size]
        return (h @ w.t() if self.kernels.matmul is None else self.kernels.matmul(h, w)).float()

    # -- the MTP blocks as a drafter -------------------------------------------------------------------------
    def streams_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of forward's output with_streams [T, H + n H] -> their residual streams [T, n, H]."""
        H = self.cfg.hidden_size
        return rows[:, H:].view(rows.shape[0], self.cfg.v4.hc_mult, H)

    def mtp_forward(self, k: int, next_ids: torch.Tensor, streams: torch.Tensor, meta: V4Meta,
                    plan: StepPlan = StepPlan()) -> torch.Tensor:
        """MTP block k over rows whose next tokens are next_ids [T] and whose residual streams (the main model's, or
        this block's previous pass) are streams [T, n, H] -> the block's output streams [T, n, H]. meta: the rows'
        chunks and their streams (the block's layer L + k of them); num_tokens is left as it is (collective: every
        rank calls it, T may be 0)."""
        block = self.mtp[k]
        x = block.e_proj(block.enorm(self.embed(next_ids)))[:, None] + block.h_proj(block.hnorm(streams))
        s = OpState(Microbatch(0, next_ids, meta, [], plan, self.dispatcher), x=x)
        for op in block.ops():
            if op is not YIELD:
                op(s)
        return s.result("x")

    def mtp_logits(self, k: int, streams: torch.Tensor) -> torch.Tensor:
        """MTP block k's output streams [T, n, H] -> logits [T, V] fp32 (the main model's head)."""
        block = self.mtp[k]
        return self.logits(block.norm(block.hc_head(streams)))
