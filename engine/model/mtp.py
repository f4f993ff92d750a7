"""DeepSeek-V3's multi-token-prediction (MTP) module as a drafter: checkpoint layer `model.layers.{L}` (L =
num_hidden_layers) with `enorm`, `hnorm`, `eh_proj`, a full decoder layer and `shared_head`. DeepSeek-V3.2 and
GLM-4.x-MoE-lite write theirs under the same names: the decoder layer is the model's own kind (V3.2: sparse
attention with its indexer, `self_attn.indexer.*`; GLM: MLA), its MLP the MoE when the checkpoint holds
`model.layers.{L}.mlp.gate.weight` (all three publish a MoE MTP layer; mlp_layer_types lists the stack only).

Legend: T rows, H hidden, V vocab. Row i takes the target's final-normed hidden state at position i
and the token at position i + 1, and predicts the token at position i + 2 (DeepSeek-V3 report, 2.2):

    x = eh_proj([enorm(embed(token_{i+1})) ; hnorm(h_i)])       # [T, 2H] -> [T, H] (vLLM's order)
    x = decoder_layer(x) at position i                           # its own cache: kv_pools[L] (+ index_pools[L])
    logits = shared_head.head(shared_head.norm(x))               # [T, V]

The embeddings are the target's (the checkpoint's `model.layers.{L}.embed_tokens` copy is not read). The
layer's MoE runs through the model's dispatcher (whichever the engine wired last) with its own initial placement
(`routing`: EPLB does not move it; recovery after a lost rank re-lays it, engine/model/family.py ExpertGroup).
Drafting k > 1 tokens feeds the layer's output back as h for the next position, as vLLM does.
"""
from __future__ import annotations

import torch
from torch import nn

from wideep.dbo.schedule import YIELD
from wideep.dbo.state import Microbatch, OpState
from wideep.eplb.placement import Placement
from wideep.moe.layer import ExpertShard
from wideep.parallel.expert_routing import ExpertRouting

from .model import DecoderLayer, _materialize, _skip_init, expert_targets


def mtp_layer_is_moe(cfg, names, model_dir: str) -> bool:
    """Whether the checkpoint's MTP layer `model.layers.{L}` (tensor `names`) has a MoE MLP (its router,
    `mlp.gate.weight`) or a dense one; raises naming the layer when the checkpoint holds none of its tensors."""
    pre = f"model.layers.{cfg.num_hidden_layers}."
    if not any(n.startswith(pre) for n in names):
        raise ValueError(f"speculative method 'mtp': the config of {model_dir!r} has num_nextn_predict_layers = "
                         f"{cfg.num_nextn_predict_layers}, but the checkpoint holds no tensor of its MTP layer "
                         f"({pre}*; transformers' save_pretrained drops them): load the published weights, or "
                         f"use method 'ngram'")
    return cfg.moe is not None and pre + "mlp.gate.weight" in names


class MTPLayer(nn.Module):
    def __init__(self, model, moe: bool, device=None, dtype: torch.dtype | None = None):
        """model: the target DeepseekModel (its config, backends, rope, embeddings and dispatcher are shared).
        moe: whether the layer's MLP is the MoE (the checkpoint says: mtp_layer_is_moe). dtype: its weights'
        (speculative draft_dtype; None: the model's). Other than the model's, the layer runs on the CPU kernels,
        which read the weights as stored with the model's activations (build.load_model checks): the rows, its
        latent cache and the dispatcher's buffers stay in the model's dtype."""
        super().__init__()
        cfg = model.cfg
        self.index = L = cfg.num_hidden_layers
        self.embed, self.rope = model.model.embed_tokens, model.rope
        self._model_dispatcher = lambda: model.dispatcher
        self.kernels = model.kernels
        dt, opt = dtype or model.dtype, model.layer_options
        self.routing = None   # its MoE's placement (slot p holds expert p % E), which EPLB leaves alone
        if moe:
            sh = model.shard or ExpertShard(cfg.moe.n_routed_experts)
            self.routing = ExpertRouting(1, list(sh.layout.slots(sh.ep_rank)))
        from wideep.layers import RMSNorm
        with torch.device("meta"), _skip_init():
            H, eps, k = cfg.hidden_size, cfg.rms_norm_eps, model.kernels
            self.enorm = RMSNorm(H, eps, dtype=dt, kernels=k)
            self.hnorm = RMSNorm(H, eps, dtype=dt, kernels=k)
            self.eh_proj = k.linear(2 * H, H, bias=False, dtype=dt)   # the backend's (decode rows: the C kernel)
            self.layer = DecoderLayer(cfg, L, model.rope, model.shard, opt["experts"], opt["attention"], dtype=dt,
                                      fp8_block=opt["fp8_block"], kv_cache_dtype=opt["kv_cache_dtype"], kernels=k,
                                      moe=moe, routing=self.routing.layers[0] if moe else None)
            self.norm = RMSNorm(H, eps, dtype=dt, kernels=k)
            self.head = nn.Linear(H, cfg.vocab_size, bias=False, dtype=dt)
        _materialize(self, device if device is not None else model.device)
        if self.layer.is_moe:
            self.layer.mlp.gate.float()
            Placement.initial(1, cfg.moe.n_routed_experts, sh.num_physical).install(
                self.routing, sh.ep_rank, sh.ep_size, self.embed.weight.device)
        self.ops = [op for op in self.layer.ops() if op is not YIELD]
        self.decode_plan = model.decode_plan   # the CPU fast path: fused halves for decode rows (fused_decode.py)
        self._fuse: bool | None = None         # whether its own weights fit fused.mtp_pass (_fusable)
        self.fused_passes = 0                  # passes run as one fused.mtp_pass call

    @property
    def dispatcher(self):
        """The target model's dispatcher, as wired now."""
        return self._model_dispatcher()

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        pre = f"model.layers.{self.index}."
        out = {pre + "enorm.weight": self.enorm.weight.data, pre + "hnorm.weight": self.hnorm.weight.data,
               pre + "eh_proj.weight": self.eh_proj.weight.data, pre + "shared_head.norm.weight": self.norm.weight.data,
               pre + "shared_head.head.weight": self.head.weight.data}
        for name, p in self.layer.named_parameters():
            if ".experts.w" not in name:
                out[pre + name] = p.data
        if self.layer.is_moe:
            for slot, e in enumerate(self.layer.mlp.local_phy2log):
                if f"{pre}mlp.experts.{e}.down_proj.weight" not in out:
                    out.update(expert_targets(self.layer.mlp.experts, self.index, e, slot))
        return out

    def forward(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor, meta, kv_pools: list, plan,
                index_pools: list | None = None) -> torch.Tensor:
        """token_ids [T] (each row's next token), prev_hidden [T, H] -> the layer's output [T, H] (collective:
        every rank calls it, T may be 0). meta: the rows' positions and slots in kv_pools[L] (and, with DSA,
        index_pools[L]: LatentKVPool.index_pools, None without)."""
        return self._layer(token_ids, self._input(token_ids, prev_hidden), meta, kv_pools, plan, index_pools)

    def first_pass(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, max_position: int, out_rows: torch.Tensor, meta, kv_pools: list, plan,
                   index_pools: list | None = None, later: tuple | None = None
                   ) -> tuple[torch.Tensor, list[list[int]], int]:
        """Rows at positions [T] (cache slots [T], the largest position max_position); only out_rows [T'] (each
        its sequence's last row) need an output -> ([T', H], each out row's drafts, the passes run). A single decoder
        layer's cache entries at a position depend on its input there only, so the other rows stop at their entries
        (eh_proj, the attention norm, kv_a_proj, and DSA's indexer key: no queries, attention or MoE), written
        first; then the layer runs over out_rows, meta describing them (collective). later: (P, positions, slots,
        lengths), host lists of out row t's P - 1 later positions at [t (P - 1) + j] (slot -1 where the row stops):
        where the passes fuse, all P run here (each row's drafts up to its stop, [T', H] its last output), else
        only this one (one draft a row; the caller runs the others: draft_pass)."""
        T = token_ids.shape[0]
        whole = out_rows.numel() == T
        rows = None
        if not whole:
            rest = torch.ones(T, dtype=torch.bool, device=token_ids.device)
            rest[out_rows] = False
            rest = rest.nonzero().squeeze(1)
            cos, sin = self.rope.cos_sin(positions[rest], max_position=max_position)
            rows = (out_rows, rest, slots[rest], cos, sin)
        if out_rows.numel():
            done = self._fused(token_ids, prev_hidden, meta, kv_pools, plan, index_pools, rows, later)
            if done is not None:
                return done
        if whole:
            out, toks = self._drafts(self.forward(token_ids, prev_hidden, meta, kv_pools, plan, index_pools))
            return out, [[t] for t in toks], 1
        x = self._input(token_ids, prev_hidden)
        extra = {} if index_pools is None else {"index_pool": index_pools[self.index]}
        self.layer.self_attn.write_entries(kv_pools[self.index], rows[2], self.layer.input_layernorm(x[rows[1]]),
                                           rows[3], rows[4], **extra)
        out, toks = self._drafts(self._layer(token_ids[out_rows], x[out_rows], meta, kv_pools, plan, index_pools))
        return out, [[t] for t in toks], 1

    def draft_pass(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor, meta, kv_pools: list, plan,
                   index_pools: list | None = None) -> tuple[torch.Tensor, list[int]]:
        """forward's output [T, H] and each row's draft, the argmax of its logits (collective). Decode rows on one
        EP rank with the CPU kernels: the input, the layer, the head and the argmax in one C call (fused.mtp_pass:
        between a pass's small Python operations its weights were read from memory again, ~2x the kernels' time)."""
        if token_ids.shape[0]:
            done = self._fused(token_ids, prev_hidden, meta, kv_pools, plan, index_pools)
            if done is not None:
                return done[0], [d[0] for d in done[1]]
        return self._drafts(self.forward(token_ids, prev_hidden, meta, kv_pools, plan, index_pools))

    def _drafts(self, out: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        return out, (self.logits(out).argmax(-1).tolist() if out.shape[0] else [])   # SYNC: drafts to the host

    def _fused(self, token_ids: torch.Tensor, prev: torch.Tensor, meta, kv_pools: list, plan,
               index_pools: list | None, rows: tuple | None = None, later: tuple | None = None
               ) -> tuple[torch.Tensor, list[list[int]], int] | None:
        """The pass (with `later`, the passes: first_pass) as one fused.mtp_pass call -> (out, each row's drafts,
        passes), or None where it cannot be (then nothing was done): the decode plan's (fused_mtp.py). rows:
        (out_rows, rest, their slots, cos, sin) when only out_rows run the layer (first_pass), else every row does."""
        if index_pools is not None or not self._fusable():
            return None
        done = self.decode_plan.mtp_passes(self, token_ids, prev, meta, kv_pools, plan, rows, later)
        if done is not None:
            self.fused_passes += done[2]
        return done

    def _fusable(self) -> bool:
        """Whether the pass's own weights fit fused.mtp_pass (the decode plan judges: fused_mtp.py fits)."""
        if self._fuse is None:
            self._fuse = self.decode_plan is not None and self.decode_plan.mtp_fits(self)
        return self._fuse

    def _input(self, token_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(self.embed(token_ids)), self.hnorm(prev_hidden)], dim=-1))

    def _layer(self, token_ids: torch.Tensor, x: torch.Tensor, meta, kv_pools: list, plan,
               index_pools: list | None) -> torch.Tensor:
        mb = Microbatch(0, token_ids, meta, kv_pools, plan, self.dispatcher, index_pools=index_pools)
        max_pos = max(meta.ctx_lens) - 1 if meta.ctx_lens else 0
        s = OpState(mb, x=x, rope=self.rope.cos_sin(meta.positions, max_position=max_pos))
        ops = self.decode_plan.extra_layer_ops(self.layer, mb) if self.decode_plan is not None else None
        for op in ops or self.ops:
            if op is not YIELD:
                op(s)
        s.take("rope")
        return s.result("x")

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, H] (forward's) -> [T, V] fp32."""
        x, w = self.norm(out), self.head.weight
        return (x @ w.t() if self.kernels.matmul is None else self.kernels.matmul(x, w)).float()
