"""The MLA family: DeepSeek-V2/V3/R1, DeepSeek-V3.2 (DSA), GLM-4.x-MoE-lite and Kimi-K2.5's text model
(engine/model/model.py DeepseekModel, its MTP layer engine/model/mtp.py), behind engine/model/family.py's interface.

Its KV cache is one paged latent pool per layer (+ DSA's indexer keys in the same slots; the MTP drafter's layer
last: engine/model/mla_cache.py), declared as one stream, "latent": the block manager (engine/sched/block_manager.py)
and the tiers (kvstore/store.py) work from that spec. On the CPU kernels a decode step may run fused (the decode
plan).
"""
from __future__ import annotations

import functools

import torch

from wideep.attention_mla.paged_decode import resolve_attention_backend
from wideep.kvstore.identity import model_identity
from wideep.layers import NATIVE, Kernels
from wideep.moe.backend import ExpertsChoice, resolve_experts_backend
from wideep.moe.fp8 import FP8_DTYPE

from .build import (ONLINE_FP8_BLOCK, _apply_quantization, _dtype_name, _unquantised_as_plain, expert_slots,
                    make_model_dispatcher, parse_dtype)
from .family import ExpertGroup, Loaded, ModelFamily
from .loader import CheckpointReader, OnlineFp8Reader, expert_ignore, load_weights, text_model_rename
from .mla_cache import LatentCache
from .model import DeepseekModel, expert_targets


class MLAFamily(ModelFamily):
    REFUSED: dict[str, str] = {}

    def check(self, cfg) -> None:
        """Every engine option is served; what needs the checkpoint or the resolved backends (quantization, the MTP
        layer's dtype) is checked at load."""

    # -- load ------------------------------------------------------------------------------------------------
    def load(self, cfg, ctx, device, progress: bool) -> Loaded:
        spec = cfg.speculative
        return self.build(cfg.model, parse_dtype(cfg.dtype), device, progress, ctx, cfg.parallel.dispatch_backend,
                          num_redundant_experts=cfg.parallel.num_redundant_experts, eplb=cfg.eplb,
                          experts_backend=cfg.experts_backend, attention_backend=cfg.attention_backend,
                          kv_cache_dtype=cfg.kv_cache_dtype, fuse_decode_stack=cfg.fuse_decode_stack,
                          mtp=spec.method == "mtp", quantization=cfg.quantization,
                          mtp_dtype=parse_dtype(spec.draft_dtype) if spec.draft_dtype else None, dispatcher=False)

    def build(self, model_dir: str, dtype: torch.dtype, device, progress: bool, ctx, dispatch_backend: str = "auto",
              num_redundant_experts: int = 0, eplb=None, experts_backend: str = "auto", attention_backend: str = "auto",
              dispatch_options: dict | None = None, kv_cache_dtype: str = "auto", fuse_decode_stack: bool = True,
              mtp: bool = False, quantization: str = "auto", mtp_dtype: torch.dtype | None = None,
              dispatcher: bool = True) -> Loaded:
        """engine/model/build.py load_model's docstring says what each option does."""
        cfg = self.cfg
        if mtp_dtype == dtype:
            mtp_dtype = None
        if mtp_dtype is not None and (mtp_dtype, dtype) != (torch.bfloat16, torch.float32):
            raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r} beside a {_dtype_name(dtype)} model: "
                             f"the MTP layer's weights can be bfloat16 beside a float32 model, else the model's dtype")
        fp8_block = cfg.quant.weight_block_size if cfg.quant is not None else None
        online = quantization == "fp8" and fp8_block is None   # an unquantised checkpoint quantised at load
        if online:
            fp8_block = ONLINE_FP8_BLOCK
        experts = (resolve_experts_backend(experts_backend, device, dtype, fp8_block, cfg.hidden_size,
                                           cfg.moe.moe_intermediate_size) if cfg.moe is not None
                   else ExpertsChoice("grouped", keep_fp8=False))
        experts = _apply_quantization(quantization, experts, fp8_block, online)
        attention = resolve_attention_backend(attention_backend, device, dtype)
        shard = placement = None
        if cfg.moe is not None:
            placement, shard = expert_slots(cfg, ctx, eplb, num_redundant_experts, len(cfg.moe_layers))
        kernels, plan = NATIVE, None
        if "cpu" in (experts.backend, attention):
            from .fused_decode import DecodePlan
            from wideep.cpu.kernels import table
            kernels = Kernels.from_table("cpu", table())
            plan = functools.partial(DecodePlan, fuse_stack=fuse_decode_stack)
        model = DeepseekModel(cfg, device=device, dtype=dtype, shard=shard,
                              dispatcher=(make_model_dispatcher(cfg, ctx, placement, device, dispatch_backend, dtype,
                                                                dispatch_options) if dispatcher else None),
                              fp8_block=fp8_block if experts.keep_fp8 else None, experts=experts, attention=attention,
                              kv_cache_dtype=kv_cache_dtype, kernels=kernels, decode_plan=plan, placement=placement)
        reader = self.reader(model_dir)
        if experts.keep_fp8 and not online:   # online: every projection the fp8 format quantises is fp8
            _unquantised_as_plain(model, reader.names, kernels.linear, dtype)
        targets = model.checkpoint_targets()
        draft = None
        if mtp:   # the MTP layer as speculative decoding's drafter (engine/model/mtp.py)
            draft = self._mtp_layer(model, reader, model_dir, mtp_dtype, kernels, attention, experts, online)
            targets.update(draft.checkpoint_targets())
        if online:
            reader = OnlineFp8Reader(reader, {n for n, t in targets.items() if t.dtype == FP8_DTYPE}, fp8_block)
        model.loaded(load_weights(reader, targets, ignore=expert_ignore(model.owns_expert),
                                  num_hidden_layers=cfg.num_hidden_layers, progress=progress))
        model.copy_local_replicas()
        if draft is not None:
            if draft.layer.is_moe:
                draft.layer.mlp.copy_local_replicas()
            draft.eval()
        if kernels.name == "cpu":   # the CPU decode streams the weights: 2 MiB pages stream faster (cpu/huge_pages.py)
            from wideep.cpu.huge_pages import collapse_module
            model.in_huge_pages(collapse_module(model) + (collapse_module(draft) if draft is not None else 0))
        return Loaded(model.eval(), draft)

    def _mtp_layer(self, model, reader, model_dir: str, mtp_dtype, kernels, attention: str, experts,
                   online: bool = False):
        cfg = self.cfg
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"speculative method 'mtp' needs the checkpoint's MTP layer, but {model_dir!r} has "
                             f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} (use method 'ngram')")
        if mtp_dtype is not None and (kernels.name != "cpu" or attention != "cpu"
                                      or (cfg.moe is not None and experts.backend != "cpu")):
            raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r} beside a {_dtype_name(model.dtype)} "
                             f"model runs on the CPU kernels (they read the MTP layer's weights as stored beside the "
                             f"model's activations), but this model's experts / attention backends are "
                             f"{experts.backend!r} / {attention!r}: leave draft_dtype out, or use the cpu backends")
        if mtp_dtype is not None and cfg.dsa is not None:
            raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r}: the MTP layer's sparse attention "
                             f"(DeepSeek-V3.2's indexer) runs on torch operations in the model's dtype "
                             f"({_dtype_name(model.dtype)}); leave draft_dtype out")
        from .mtp import MTPLayer, mtp_layer_is_moe
        draft = MTPLayer(model, mtp_layer_is_moe(cfg, reader.names, model_dir), dtype=mtp_dtype)
        if experts.keep_fp8 and not online:
            _unquantised_as_plain(draft.layer, reader.names, kernels.linear, mtp_dtype or model.dtype,
                                  prefix=f"model.layers.{draft.index}.")
        return draft

    def reader(self, model_dir: str) -> CheckpointReader:
        return CheckpointReader(model_dir, rename=text_model_rename if self.cfg.wrapper is not None else None)

    # -- the KV cache --------------------------------------------------------------------------------------
    def kv_cache(self, cfg, loaded: Loaded, max_model_len: int) -> LatentCache:
        layers = self.cfg.num_hidden_layers + (loaded.draft is not None)   # the MTP drafter's own latents last
        return LatentCache.sized(cfg, self.cfg, loaded.model.dtype, loaded.model.device, layers, max_model_len,
                                 model=self.model_name)

    def block_manager(self, cfg, kv: LatentCache, store, log, whole_chunks: bool):
        from ..sched.block_manager import BlockManager
        return BlockManager(kv.spec, {"latent": kv.num_blocks}, enable_prefix_caching=cfg.enable_prefix_caching,
                            log=log, store=store)

    def kv_store(self, cfg, kv: LatentCache, log, prefer: int):
        """The tiers below the device cache ([kv_cache] tiers): the latent stream's block rows of every per-layer
        pool."""
        from wideep.kvstore.store import TieredStore
        pools = kv.all_pools()   # every per-layer tensor: the latents, and DSA's keys
        identities = None
        if "disk" in cfg.kv_cache.tiers:
            # the cache dtype by name (an fp8 tier never serves a full-precision cache, nor the reverse),
            # with the model dtype its RoPE part is stored in
            fp8 = kv.fp8
            dtype = str(pools[0].dtype) if fp8 is None else f"{kv.kv_cache_dtype}+rope:{fp8.rope_dtype}"
            if cfg.quantization == "fp8" and self.cfg.quant is None:   # weights quantised at load: other latents
                dtype += "+weights:fp8"
            identities = {"latent": model_identity(cfg.model, dtype, cfg.block_size,
                                                   [(cfg.block_size, p.shape[1]) for p in pools])}
        return TieredStore(cfg.kv_cache, kv.spec, kv.stream_pools(), identities, prefer=prefer, log=log)

    # -- speculative decoding ------------------------------------------------------------------------------
    def drafter(self, loaded: Loaded, kv: LatentCache, k: int):
        from ..spec_decode.drafter import MTPDrafter
        from ..spec_decode.mla_passes import MLAPasses
        return MTPDrafter(MLAPasses(loaded.draft, kv), k)

    # -- the routed experts --------------------------------------------------------------------------------
    def expert_groups(self, loaded: Loaded) -> list[ExpertGroup]:
        model, draft = loaded.model, loaded.draft
        if model.placement is None:
            return []
        index = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
        groups = [ExpertGroup("layers", model.moe_layers(),
                              lambda ex, l, e, slot: expert_targets(ex, index[l], e, slot),
                              model.routing, model.placement, rebalanced=True)]
        if draft is not None and draft.layer.is_moe:
            groups.append(ExpertGroup("mtp", [draft.layer.mlp],
                                      lambda ex, l, e, slot: expert_targets(ex, draft.index, e, slot),
                                      draft.routing, draft.routing.placement))
        return groups
