"""Build a model on this rank: config, expert shard, dispatcher, weights (only this rank's experts)."""
from __future__ import annotations

import dataclasses
import functools
import re

import torch

from wideep.attention_mla.paged_decode import resolve_attention_backend
from wideep.eplb.config import EplbConfig
from wideep.eplb.placement import Placement
from wideep.layers import NATIVE, Kernels
from wideep.moe.backend import ExpertsChoice, resolve_experts_backend
from wideep.moe.fp8_linear import Fp8Linear
from wideep.moe.layer import ExpertShard
from wideep.parallel.context import ParallelContext
from wideep.parallel.dispatch import make_dispatcher

from .model_config import ModelConfig
from .loader import (CheckpointReader, expert_ignore, load_weights, text_model_rename, v4_ignore, v4_mtp_blocks,
                     v4_rename)
from .model import DeepseekModel, _skip_init

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {sorted(DTYPES)})")
    return DTYPES[dtype]


QUANTIZATION = ("auto", "fp8", "fp4", "none")


def _apply_quantization(quantization: str, experts: ExpertsChoice, fp8_block) -> ExpertsChoice:
    """The experts choice with keep_fp8 as `quantization` asks (load_model's docstring says what each means)."""
    if quantization not in QUANTIZATION:
        raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATION}")
    if quantization == "fp4":
        raise ValueError("quantization 'fp4' keeps DeepSeek-V4's FP4 routed experts as stored; this checkpoint is "
                         "not DeepSeek-V4")
    if quantization == "none":
        return dataclasses.replace(experts, keep_fp8=False) if experts.backend != "deepgemm" else _no_dequant()
    if quantization == "fp8":
        if fp8_block is None:
            raise ValueError("quantization 'fp8' keeps an fp8 checkpoint's weights as stored, but the checkpoint has "
                             "no quantization_config with quant_method 'fp8'")
        if not experts.keep_fp8:
            raise ValueError(f"quantization 'fp8': the experts backend {experts.backend!r} computes on dequantised "
                             f"weights (fp8 is kept by cpu, triton and deepgemm; the block along K, "
                             f"{fp8_block[1]}, must be a multiple of 16)")
    return experts


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _no_dequant():
    raise ValueError("quantization 'none' dequantises the weights at load, but the deepgemm experts backend computes "
                     "on fp8 weights only: choose another experts_backend")


def _unquantised_as_plain(model, names, linear, dtype: torch.dtype, prefix: str = "") -> None:
    """Every Fp8Linear whose weight the checkpoint stores unquantised (no `<weight>_scale_inv`: a checkpoint may
    leave some projections out of its fp8 blocks) becomes the backend's plain linear in `dtype`, before loading.
    prefix: the checkpoint's name of `model` (a drafter's layer), "" for the whole model."""
    for name, m in list(model.named_modules()):
        if isinstance(m, Fp8Linear) and f"{prefix}{name}.weight_scale_inv" not in names:
            parent, _, attr = name.rpartition(".")
            with _skip_init():
                plain = linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device,
                               dtype=dtype)
            setattr(model.get_submodule(parent), attr, plain.requires_grad_(False))


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True, ctx: ParallelContext | None = None, dispatch_backend: str = "auto",
               cfg: ModelConfig | None = None, num_redundant_experts: int = 0,
               eplb: EplbConfig | dict | None = None, experts_backend: str = "auto",
               attention_backend: str = "auto", dispatch_options: dict | None = None,
               kv_cache_dtype: str = "auto", fuse_decode_stack: bool = True, mtp: bool = False,
               quantization: str = "auto", mtp_dtype: torch.dtype | None = None) -> DeepseekModel:
    """Single process when ctx is None or has ep_size 1 (the MoE layers' dispatcher is then the
    LocalDispatcher); otherwise this rank's expert slice plus everything replicated, with a
    dispatcher for the MoE all-to-all.

    Routed experts occupy n_routed_experts + redundant physical slots per MoE layer (redundant:
    eplb.num_redundant_experts or num_redundant_experts, i.e. ParallelConfig's), placed by
    eplb.initial_placement (a file) or slot p -> expert p % n_routed_experts; each rank reads only
    the experts its slots hold. EPLB's controller (eplb.EplbController) later moves them.

    experts_backend / attention_backend: "auto" | "torch" | "cpu" | "triton" (| "deepgemm" for experts),
    resolved here for `device` (moe/backend.py, attention_mla/paged_decode.py) and given to the model's
    constructor; model.backends records what was chosen. With an fp8 checkpoint, a kernel experts
    backend (triton, deepgemm) keeps the routed experts and the attention/MLP projections fp8 on the
    device (Triton W8A16 linears). dispatch_options: extra make_dispatcher keywords (low-latency
    thresholds, the simulated link). kv_cache_dtype: "auto" | "fp8" | "fp4" (attention_mla/fp8_cache.py,
    fp4_cache.py): what the attention layers write to and read from the latent cache.

    quantization (QUANTIZATION; what an fp8 checkpoint's weights are in memory, docs/kernels.md): "auto" keeps
    them fp8 where the experts backend computes on fp8 (cpu, triton, deepgemm) and dequantises them at load
    into `dtype` elsewhere; "fp8" keeps them fp8 or raises saying why it cannot; "none" dequantises at load
    whatever the backend (the float32 / bfloat16 model of the same weights). The checkpoint's
    quantization_config says whether it is fp8 (vLLM's and SGLang's `quantization` detect it the same way).
    DeepSeek-V4 (_v4_experts): its FP8 linears are dequantised at load; its FP4 routed experts stay packed (half a
    byte a weight + an e8m0 byte per 32) under "auto" and "fp4" where the cpu experts kernel reads them, "fp4"
    raising where it cannot; "none" dequantises them.

    The per-op kernels (layers/kernels.py) are the CPU backend's when either backend resolved to "cpu"
    (cpu/kernels.py), with its decode plan (cpu/decode_plan.py; fuse_decode_stack: its whole-stack
    call); torch ops otherwise.

    mtp: load the checkpoint's MTP layer as speculative decoding's drafter (model.drafter), its weights in mtp_dtype
    (speculative draft_dtype; None: `dtype`). A dtype other than the model's needs the CPU kernels (they read
    bfloat16 weights beside float32 activations: experts and attention backends "cpu") and a
    DeepSeek-V3 / GLM-lite MTP layer (not V3.2's sparse attention, not V4's block)."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    if mtp_dtype == dtype:
        mtp_dtype = None
    if mtp_dtype is not None and (mtp_dtype, dtype) != (torch.bfloat16, torch.float32):
        raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r} beside a {_dtype_name(dtype)} model: "
                         f"the MTP layer's weights can be bfloat16 beside a float32 model, else the model's dtype")
    if mtp_dtype is not None and cfg.v4 is not None:
        raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r}: DeepSeek-V4's MTP block runs in the "
                         f"model's dtype ({_dtype_name(dtype)}); leave draft_dtype out")
    if cfg.v4 is not None:
        if quantization == "fp8":
            raise ValueError("quantization 'fp8': DeepSeek-V4's FP8 linears are dequantised at load (no V4 kernel "
                             "reads them as stored yet; its FP4 experts: quantization 'fp4' or 'auto')")
        if quantization not in QUANTIZATION:
            raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATION}")
        return _load_v4(model_dir, cfg, dtype, device, progress, ctx, dispatch_backend, num_redundant_experts, eplb,
                        experts_backend, attention_backend, kv_cache_dtype, dispatch_options, quantization, mtp)
    fp8_block = cfg.quant.weight_block_size if cfg.quant is not None else None
    experts = (resolve_experts_backend(experts_backend, device, dtype, fp8_block, cfg.hidden_size,
                                       cfg.moe.moe_intermediate_size) if cfg.moe is not None
               else ExpertsChoice("grouped", keep_fp8=False))
    experts = _apply_quantization(quantization, experts, fp8_block)
    attention = resolve_attention_backend(attention_backend, device, dtype)
    eplb = EplbConfig.coerce(eplb)
    shard, dispatcher, placement = None, None, None
    ep_rank, ep_size = (ctx.ep_rank, ctx.ep_size) if ctx is not None else (0, 1)
    if cfg.moe is not None:
        E = cfg.moe.n_routed_experts
        num_physical = E + eplb.validate(ep_size, E, num_redundant_experts)
        num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        placement = (Placement.load(eplb.initial_placement, num_moe, E, num_physical) if eplb.initial_placement
                     else Placement.initial(num_moe, E, num_physical))
        if ep_size > 1 or num_physical != E:
            shard = ExpertShard(num_physical, ep_rank, ep_size)
        # one EP rank gets the LocalDispatcher: the MoE layers have one path whatever the EP size
        dispatcher = make_dispatcher(ctx or ParallelContext.single(device), num_physical, cfg.hidden_size,
                                     dispatch_backend, dtype=dtype, **(dispatch_options or {}))
    kernels, plan = NATIVE, None
    if "cpu" in (experts.backend, attention):
        from .fused_decode import DecodePlan
        from wideep.cpu.kernels import table
        kernels = Kernels.from_table("cpu", table())
        plan = functools.partial(DecodePlan, fuse_stack=fuse_decode_stack)
    model = DeepseekModel(cfg, device=device, dtype=dtype, shard=shard, dispatcher=dispatcher,
                          fp8_block=fp8_block if experts.keep_fp8 else None, experts=experts, attention=attention,
                          kv_cache_dtype=kv_cache_dtype, kernels=kernels, decode_plan=plan)
    if placement is not None:
        placement.install(model.routing, ep_rank, ep_size, model.device)
        model.placement = placement
    reader = CheckpointReader(model_dir, rename=text_model_rename if cfg.wrapper is not None else None)
    if experts.keep_fp8:
        _unquantised_as_plain(model, reader.names, kernels.linear, dtype)
    targets = model.checkpoint_targets()
    drafter = None
    if mtp:   # the MTP layer as speculative decoding's drafter (engine/model/mtp.py)
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError(f"speculative method 'mtp' needs the checkpoint's MTP layer, but {model_dir!r} has "
                             f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers} (use method 'ngram')")
        if mtp_dtype is not None and (kernels.name != "cpu" or attention != "cpu"
                                      or (cfg.moe is not None and experts.backend != "cpu")):
            raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r} beside a {_dtype_name(dtype)} model "
                             f"runs on the CPU kernels (they read the MTP layer's weights as stored beside the "
                             f"model's activations), but this model's experts / attention backends are "
                             f"{experts.backend!r} / {attention!r}: leave draft_dtype out, or use the cpu backends")
        if mtp_dtype is not None and cfg.dsa is not None:
            raise ValueError(f"speculative draft_dtype {_dtype_name(mtp_dtype)!r}: the MTP layer's sparse attention "
                             f"(DeepSeek-V3.2's indexer) runs on torch operations in the model's dtype "
                             f"({_dtype_name(dtype)}); leave draft_dtype out")
        from .mtp import MTPLayer, mtp_layer_is_moe
        drafter = MTPLayer(model, mtp_layer_is_moe(cfg, reader.names, model_dir), dtype=mtp_dtype)
        if experts.keep_fp8:
            _unquantised_as_plain(drafter.layer, reader.names, kernels.linear, mtp_dtype or dtype,
                                  prefix=f"model.layers.{drafter.index}.")
        targets.update(drafter.checkpoint_targets())
    model.load_report = load_weights(reader, targets, ignore=expert_ignore(model.owns_expert),
                                     num_hidden_layers=cfg.num_hidden_layers, progress=progress)
    model.copy_local_replicas()
    if drafter is not None:
        if drafter.layer.is_moe:
            drafter.layer.mlp.copy_local_replicas()
        drafter.eval()
    object.__setattr__(model, "drafter", drafter)   # not a submodule: the target's parameters and targets stay its own
    if kernels.name == "cpu":   # the CPU decode streams the weights: 2 MiB pages stream faster (cpu/huge_pages.py)
        from wideep.cpu.huge_pages import collapse_module
        model.huge_page_bytes = collapse_module(model) + (collapse_module(drafter) if drafter is not None else 0)
    return model.eval()


_V4_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def _v4_experts(reader, cfg, device, dtype, experts_backend: str, quantization: str) -> tuple[ExpertsChoice, Kernels]:
    """DeepSeek-V4's routed experts: (choice, the experts' kernel table). FP4 experts in the checkpoint stay packed
    (keep_fp4, backend "cpu") when quantization is "auto" or "fp4", experts_backend "auto" or "cpu", the CPU
    kernels are usable for `device` / `dtype` and hidden and moe_intermediate_size are multiples of 32; "fp4"
    raises naming what is missing. Otherwise: "cpu" when asked (the C kernel on dequantised weights), else torch."""
    if experts_backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"DeepSeek-V4 experts (clamped SwiGLU) run on the torch or cpu backend, not experts_backend "
                         f"{experts_backend!r}")
    from wideep.cpu.build import unusable_for
    stored = next((n for n in sorted(reader.names) if _V4_EXPERT.match(n)), None)
    H, I = cfg.hidden_size, cfg.moe.moe_intermediate_size
    why_not = ("the checkpoint's routed experts are not FP4" if stored is None or not reader.is_fp4(stored)
               else "quantization 'none' dequantises them" if quantization == "none"
               else f"experts_backend {experts_backend!r} does not read FP4 (the cpu one does)"
               if experts_backend == "torch"
               else f"hidden_size ({H}) and moe_intermediate_size ({I}) must be multiples of 32"
               if H % 32 or I % 32 else unusable_for(torch.device(device), dtype))
    if quantization == "fp4" and why_not is not None:
        raise ValueError(f"quantization 'fp4' keeps DeepSeek-V4's FP4 experts as stored, but {why_not}")
    if why_not is not None and experts_backend != "cpu":
        return ExpertsChoice("grouped", keep_fp8=False), NATIVE
    why_not_cpu = unusable_for(torch.device(device), dtype)
    if why_not_cpu is not None:
        raise ValueError(f"experts_backend 'cpu' is not usable: {why_not_cpu}")
    from wideep.cpu.kernels import table
    return ExpertsChoice("cpu", keep_fp8=False, keep_fp4=why_not is None), Kernels(name="cpu", experts=table()["experts"])


def _load_v4(model_dir, cfg, dtype, device, progress, ctx, dispatch_backend, num_redundant_experts, eplb,
             experts_backend, attention_backend, kv_cache_dtype, dispatch_options, quantization="auto", mtp=False):
    """DeepSeek-V4 (engine/model/v4_model.py): torch attention; routed experts on torch or the cpu experts kernel
    (FP4 ones kept packed: _v4_experts); no CPU decode plan. kv_cache_dtype is the pools' (engine/worker/v4_runner.py):
    the model reads its streams in the model dtype either way. mtp: speculative method "mtp" (MTP block 0 drafts,
    engine/worker/v4_mtp_drafter.py): the checkpoint must hold it, and it must be a sliding-window block."""
    from .v4_model import DeepseekV4Model
    if attention_backend not in ("auto", "torch"):
        raise ValueError(f"DeepSeek-V4 attention runs on the torch backend only, not attention_backend "
                         f"{attention_backend!r}")
    from wideep.attention_v4.fp8 import check_v4_kv_cache_dtype
    check_v4_kv_cache_dtype(kv_cache_dtype)
    eplb = EplbConfig.coerce(eplb)
    ep_rank, ep_size = (ctx.ep_rank, ctx.ep_size) if ctx is not None else (0, 1)
    E = cfg.moe.n_routed_experts
    num_physical = E + eplb.validate(ep_size, E, num_redundant_experts)
    L = cfg.num_hidden_layers
    placement = (Placement.load(eplb.initial_placement, L, E, num_physical) if eplb.initial_placement
                 else Placement.initial(L, E, num_physical))
    shard = ExpertShard(num_physical, ep_rank, ep_size) if ep_size > 1 or num_physical != E else None
    dispatcher = make_dispatcher(ctx or ParallelContext.single(device), num_physical, cfg.hidden_size,
                                 dispatch_backend, dtype=dtype, **(dispatch_options or {}))
    reader = CheckpointReader(model_dir, rename=v4_rename)
    experts, experts_kernels = _v4_experts(reader, cfg, device, dtype, experts_backend, quantization)
    model = DeepseekV4Model(cfg, device=device, dtype=dtype, shard=shard, dispatcher=dispatcher, experts=experts,
                            num_mtp=v4_mtp_blocks(reader.names, cfg.num_nextn_predict_layers),
                            experts_kernels=experts_kernels)
    placement.install(model.routing, ep_rank, ep_size, model.device)
    model.placement = placement
    if model.mtp:   # their own initial placement, which EPLB leaves alone
        Placement.initial(len(model.mtp), E, num_physical).install(model.mtp_routing, ep_rank, ep_size, model.device)
    if mtp and not model.mtp:
        raise ValueError(f"speculative method 'mtp' needs the checkpoint's MTP block (mtp.0.*), but {model_dir!r} "
                         f"holds none (num_nextn_predict_layers = {cfg.num_nextn_predict_layers}; use method 'ngram')")
    if mtp and cfg.v4.mtp_layer_kinds[0] != "sliding":
        raise ValueError(f"speculative method 'mtp': MTP block 0 of {model_dir!r} has {cfg.v4.mtp_layer_kinds[0]!r} "
                         f"attention (compress_ratios past the layers); only a sliding-window MTP block drafts (its "
                         f"compressor state would have to be rewound after every draft pass)")
    model.load_report = load_weights(reader, model.checkpoint_targets(), ignore=v4_ignore(model.owns_expert, L),
                                     progress=progress)
    model.copy_local_replicas()
    return model.eval()
