"""DeepSeek-V4 (engine/model/v4_model.py: sliding-window + CSA/HCA attention, hyper-connections, hash-routed MoE, its
MTP blocks), behind engine/model/family.py's interface.

Its KV cache is one paged pool per stream (window, compressed entries, indexer keys, a slot per sequence for the
compressors' state: engine/model/v4_cache.py), declared as a KV spec (attention_v4/pool_layout.py): the block manager
(engine/sched/block_manager.py) and the tiers (kvstore/store.py) work from it. On the CPU kernels (attention_backend
"auto" / "cpu") its projections, norms, hyper-connections and head run on the C kernel table and a decode step's
attention runs batched over its sequences (attention_v4/decode.py); "torch" is the reference. The routed experts run on
torch or the cpu experts kernel (FP4 ones kept packed); its FP8 projections stay FP8 on the CPU kernels, else are
dequantised at load.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from wideep.attention_v4.fp8 import V4_KV_CACHE_DTYPES, check_v4_kv_cache_dtype
from wideep.kvstore.identity import model_identity
from wideep.layers import NATIVE, Kernels
from wideep.moe.backend import ExpertsChoice

from .build import ONLINE_FP8_BLOCK, QUANTIZATION, expert_slots, make_model_dispatcher, parse_dtype
from .family import ExpertGroup, Loaded, ModelFamily
from .loader import CheckpointReader, OnlineFp8Reader, load_weights, v4_ignore, v4_mtp_blocks, v4_rename
from .v4_cache import V4StreamCache
from .v4_model import v4_expert_targets

# "torch": the reference (every op on torch, a decode step's attention one sequence at a time); "cpu": the CPU
# kernels' projections / norms / head and batched decode steps (attention_v4/decode.py); "auto": "cpu" where usable,
# else torch with batched decode steps
ATTENTION_BACKENDS = ("auto", "torch", "cpu")
_V4_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


class V4Family(ModelFamily):
    REFUSED = {
        "speculative method 'mtp' with prefill/decode disaggregation":
            "the MTP block's window rows are not sent with the streams yet; use method 'ngram'",
    }

    def check(self, cfg) -> None:
        name = self.model_name
        if cfg.kv_cache_dtype not in V4_KV_CACHE_DTYPES:
            raise ValueError(f"{name} does not support kv_cache_dtype {cfg.kv_cache_dtype!r} (V4 streams are kept in "
                             f"the model dtype or fp8: 'auto', 'fp8') yet")
        self._check_attention_backend(cfg.attention_backend)
        if cfg.experts_backend not in ("auto", "torch", "cpu"):
            raise ValueError(f"{name} does not support experts_backend {cfg.experts_backend!r}: DeepSeek-V4 experts "
                             f"(clamped SwiGLU) run on the torch or cpu backend")
        self._check_quantization(cfg.quantization)
        d = cfg.speculative.draft_dtype
        if d is not None and parse_dtype(d) != parse_dtype(cfg.dtype):
            raise ValueError(f"{name} does not support speculative draft_dtype {d!r}: DeepSeek-V4's MTP block runs in "
                             f"the model's dtype ({cfg.dtype}); leave draft_dtype out")

    def _check_quantization(self, quantization: str) -> None:
        if quantization not in QUANTIZATION:
            raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATION}")

    # -- load ------------------------------------------------------------------------------------------------
    def load(self, cfg, ctx, device, progress: bool) -> Loaded:
        mtp = cfg.speculative.method == "mtp"
        loaded = self.build(cfg.model, parse_dtype(cfg.dtype), device, progress, ctx, cfg.parallel.dispatch_backend,
                            num_redundant_experts=cfg.parallel.num_redundant_experts, eplb=cfg.eplb,
                            experts_backend=cfg.experts_backend, attention_backend=cfg.attention_backend,
                            kv_cache_dtype=cfg.kv_cache_dtype, quantization=cfg.quantization, mtp=mtp,
                            dispatcher=False)
        return loaded

    def build(self, model_dir: str, dtype: torch.dtype, device, progress: bool, ctx, dispatch_backend: str = "auto",
              num_redundant_experts: int = 0, eplb=None, experts_backend: str = "auto", attention_backend: str = "auto",
              dispatch_options: dict | None = None, kv_cache_dtype: str = "auto", fuse_decode_stack: bool = True,
              mtp: bool = False, quantization: str = "auto", dispatcher: bool = True) -> Loaded:
        """Torch attention; routed experts on torch or the cpu experts kernel (FP4 ones kept packed: _experts); no
        CPU decode plan. kv_cache_dtype is the pools' (engine/model/v4_cache.py): the model reads its streams in the
        model dtype either way. The checkpoint's MTP blocks are loaded whenever it holds them; mtp (speculative
        method "mtp": block 0 drafts, engine/spec_decode/v4_passes.py) needs block 0, a sliding-window block."""
        from .v4_model import DeepseekV4Model
        cfg = self.cfg
        native = self._native(attention_backend, device, dtype)
        self._check_quantization(quantization)
        check_v4_kv_cache_dtype(kv_cache_dtype)
        L = cfg.num_hidden_layers
        placement, shard = expert_slots(cfg, ctx, eplb, num_redundant_experts, L)
        reader = self.reader(model_dir)
        experts = self._experts(reader, device, dtype, experts_backend, quantization, native)
        fp8_block, online = self._fp8_linears(reader, quantization, native, attention_backend, device, dtype)
        kernels = NATIVE
        if native or experts.backend == "cpu":
            from wideep.cpu.kernels import table
            kernels = (dataclasses.replace(Kernels.from_table("cpu", table()), route=None) if native
                       else Kernels(name="cpu", experts=table()["experts"]))
        num_mtp = v4_mtp_blocks(reader.names, cfg.num_nextn_predict_layers)
        if mtp and not num_mtp:
            raise ValueError(f"speculative method 'mtp' needs the checkpoint's MTP block (mtp.0.*), but {model_dir!r} "
                             f"holds none (num_nextn_predict_layers = {cfg.num_nextn_predict_layers}; use method "
                             f"'ngram')")
        if mtp and cfg.v4.mtp_layer_kinds[0] != "sliding":
            raise ValueError(f"speculative method 'mtp': MTP block 0 of {model_dir!r} has {cfg.v4.mtp_layer_kinds[0]!r}"
                             f" attention (compress_ratios past the layers); only a sliding-window MTP block drafts "
                             f"(its compressor state would have to be rewound after every draft pass)")
        model = DeepseekV4Model(cfg, device=device, dtype=dtype, shard=shard,
                                dispatcher=(make_model_dispatcher(cfg, ctx, placement, device, dispatch_backend, dtype,
                                                                  dispatch_options) if dispatcher else None),
                                experts=experts, num_mtp=num_mtp, kernels=kernels, placement=placement,
                                with_streams=mtp, batched_decode=attention_backend != "torch", fp8_block=fp8_block)
        model.backends["fp8_online"] = online
        targets = model.checkpoint_targets()
        if online:   # a bf16 / float32 checkpoint: its FP8 targets quantised at load, in DeepSeek's format
            from wideep.moe.fp8 import FP8_DTYPE
            reader = OnlineFp8Reader(reader, {n for n, t in targets.items() if t.dtype == FP8_DTYPE}, fp8_block)
        model.loaded(load_weights(reader, targets, ignore=v4_ignore(model.owns_expert, L), progress=progress))
        model.copy_local_replicas()
        return Loaded(model.eval(), model.mtp[0] if mtp else None)

    def _check_attention_backend(self, attention_backend: str) -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"{self.model_name} does not support attention_backend {attention_backend!r}: "
                             f"DeepSeek-V4 attention runs on {' / '.join(ATTENTION_BACKENDS)}")

    def _native(self, attention_backend: str, device, dtype) -> bool:
        """Whether the model runs on the CPU backend's kernels (attention_backend "cpu", or "auto" where they are
        usable): its projections, norms and head on the C kernels, its decode steps batched (attention_v4/decode.py).
        "torch" is the reference (every op on torch, a decode step one sequence at a time); "auto" elsewhere batches
        the decode steps on torch."""
        self._check_attention_backend(attention_backend)
        if attention_backend == "torch":
            return False
        from wideep.cpu.build import unusable_for
        why_not = unusable_for(torch.device(device), dtype)
        if attention_backend == "cpu" and why_not is not None:
            raise ValueError(f"{self.model_name}: attention_backend 'cpu' is not usable: {why_not}")
        return why_not is None

    def _fp8_linears(self, reader, quantization: str, native: bool, attention_backend: str, device,
                     dtype) -> tuple[tuple[int, int] | None, bool]:
        """(fp8_block, online): whether the attention's five projections and the shared experts keep FP8 weights (the
        blocks) and whether they are quantised at load. DeepSeek stores them FP8: kept as stored for "auto" / "fp4"
        on the CPU kernels (the fp8 GEMM reads the e4m3 bytes; the block along K a multiple of 16), else
        dequantised. "fp8": kept, or quantised at load from a bf16 / float32 checkpoint into 128 x 128 tiles
        (vLLM's online FP8); an error naming what is missing where the CPU kernels are not in use."""
        probe = "layers.0.attn.wq_a.weight"
        stored = probe in reader.names and reader.is_fp8(probe)
        block = reader.block_size if stored else ONLINE_FP8_BLOCK
        if quantization == "fp8":
            if not native:
                from wideep.cpu.build import unusable_for
                why = ("attention_backend 'torch' computes on dequantised weights" if attention_backend == "torch"
                       else unusable_for(torch.device(device), dtype))
                raise ValueError(f"{self.model_name}: quantization 'fp8' keeps the FP8 projections on the cpu "
                                 f"kernels' fp8 GEMM, but {why}")
            if block[1] % 16:
                raise ValueError(f"{self.model_name}: quantization 'fp8' needs the fp8 block along K ({block[1]}) to "
                                 f"be a multiple of 16 (the cpu fp8 GEMM)")
            return block, not stored
        if stored and native and quantization in ("auto", "fp4") and block[1] % 16 == 0:
            return block, False
        return None, False

    def _experts(self, reader, device, dtype, experts_backend: str, quantization: str,
                 native: bool = False) -> ExpertsChoice:
        """DeepSeek-V4's routed experts. FP4 experts in the checkpoint stay packed (keep_fp4, backend "cpu") when
        quantization is "auto" or "fp4", experts_backend "auto" or "cpu", the CPU kernels are usable for `device` /
        `dtype` and hidden and moe_intermediate_size are multiples of 32; "fp4" raises naming what is missing.
        Otherwise: "cpu" (the C kernel on dequantised weights) when asked, or for "auto" on the native path (native:
        _native's answer), else torch."""
        if experts_backend not in ("auto", "torch", "cpu"):
            raise ValueError(f"{self.model_name} does not support experts_backend {experts_backend!r}: DeepSeek-V4 "
                             f"experts (clamped SwiGLU) run on the torch or cpu backend")
        from wideep.cpu.build import unusable_for
        stored = next((n for n in sorted(reader.names) if _V4_EXPERT.match(n)), None)
        H, I = self.cfg.hidden_size, self.cfg.moe.moe_intermediate_size
        why_not = ("the checkpoint's routed experts are not FP4" if stored is None or not reader.is_fp4(stored)
                   else "quantization 'none' dequantises them" if quantization == "none"
                   else f"experts_backend {experts_backend!r} does not read FP4 (the cpu one does)"
                   if experts_backend == "torch"
                   else f"hidden_size ({H}) and moe_intermediate_size ({I}) must be multiples of 32"
                   if H % 32 or I % 32 else unusable_for(torch.device(device), dtype))
        if quantization == "fp4" and why_not is not None:
            raise ValueError(f"quantization 'fp4' keeps DeepSeek-V4's FP4 experts as stored, but {why_not}")
        if why_not is not None and (experts_backend == "torch" or (experts_backend == "auto" and not native)):
            return ExpertsChoice("grouped", keep_fp8=False)
        why_not_cpu = unusable_for(torch.device(device), dtype)
        if why_not_cpu is not None:
            raise ValueError(f"experts_backend 'cpu' is not usable: {why_not_cpu}")
        return ExpertsChoice("cpu", keep_fp8=False, keep_fp4=why_not is None)

    def reader(self, model_dir: str) -> CheckpointReader:
        return CheckpointReader(model_dir, rename=v4_rename)

    # -- the KV cache --------------------------------------------------------------------------------------
    def kv_cache(self, cfg, loaded: Loaded, max_model_len: int) -> V4StreamCache:
        """The MTP block that drafts keeps its window in layer L of every pool."""
        return V4StreamCache(loaded.model, cfg.kv_cache_memory, cfg.block_size, cfg.max_num_seqs, max_model_len,
                             cfg.max_num_batched_tokens, cfg.kv_cache_blocks, cfg.enable_prefix_caching,
                             cfg.kv_cache_dtype, mtp_layers=int(loaded.draft is not None))

    def block_manager(self, cfg, kv: V4StreamCache, store, log, whole_chunks: bool):
        """One pool per stream, a slot per sequence (DBO may cut a chunk between microbatches: whole_chunks gives
        window blocks for all of it); the cache drops a sequence's streams when its blocks are freed."""
        from ..sched.block_manager import BlockManager
        return BlockManager(kv.spec, kv.num_blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            whole_chunks=whole_chunks, on_free=kv.drop, enable_prefix_caching=cfg.enable_prefix_caching,
                            log=log, store=store)

    def kv_store(self, cfg, kv: V4StreamCache, log, prefer: int):
        """The tiers of every stream, each stream's disk directory named by its block layout and the cache dtype."""
        from wideep.kvstore.store import TieredStore, block_rows
        pools = kv.stream_pools()
        identities = None
        if "disk" in cfg.kv_cache.tiers:
            dtype = f"v4:{kv.kv_cache_dtype}:{kv.model.dtype}"
            if cfg.quantization == "fp8" and kv.model.backends.get("fp8_online"):   # quantised at load: other KV
                dtype += "+weights:fp8"
            identities = {s: model_identity(cfg.model, f"{dtype}:{s}", cfg.block_size,
                                            [tuple(r.shape[1:]) for r in block_rows(ps)]) for s, ps in pools.items()}
        return TieredStore(cfg.kv_cache, kv.spec, pools, identities, prefer=prefer, log=log)

    # -- speculative decoding ------------------------------------------------------------------------------
    def drafter(self, loaded: Loaded, kv: V4StreamCache, k: int):
        from ..spec_decode.drafter import MTPDrafter
        from ..spec_decode.v4_passes import V4Passes
        return MTPDrafter(V4Passes(loaded.model, kv), k)

    # -- the routed experts --------------------------------------------------------------------------------
    def expert_groups(self, loaded: Loaded) -> list[ExpertGroup]:
        model = loaded.model
        groups = [ExpertGroup("layers", model.moe_layers(),
                              lambda ex, l, e, slot: v4_expert_targets(ex, f"layers.{l}.", e, slot),
                              model.routing, model.placement, rebalanced=True)]
        if len(model.mtp):
            groups.append(ExpertGroup("mtp", [block.ffn for block in model.mtp],
                                      lambda ex, k, e, slot: v4_expert_targets(ex, f"mtp.{k}.", e, slot),
                                      model.mtp_routing, model.mtp_routing.placement))
        return groups
