"""Which family a checkpoint belongs to (the one place that branches on it), and load_model, which builds any
family's model on this rank."""
from __future__ import annotations

import torch

from wideep.eplb.config import EplbConfig
from wideep.parallel.context import ParallelContext

from .family import ModelFamily
from .mla_family import MLAFamily
from .model_config import ModelConfig
from .v4_family import V4Family


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of a ModelConfig: DeepSeek-V4, or the MLA family (V2/V3/V3.2/GLM-lite/Kimi-K2.5)."""
    return V4Family(cfg) if cfg.v4 is not None else MLAFamily(cfg)


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True, ctx: ParallelContext | None = None, dispatch_backend: str = "auto",
               cfg: ModelConfig | None = None, num_redundant_experts: int = 0,
               eplb: EplbConfig | dict | None = None, experts_backend: str = "auto",
               attention_backend: str = "auto", dispatch_options: dict | None = None,
               kv_cache_dtype: str = "auto", fuse_decode_stack: bool = True, quantization: str = "auto"):
    """The model of `model_dir` on this rank, by its family (engine/model/family.py): single process when ctx is None
    or has ep_size 1 (the MoE layers' dispatcher is then the LocalDispatcher); otherwise this rank's expert slice plus
    everything replicated, with a dispatcher for the MoE all-to-all.

    Routed experts occupy n_routed_experts + redundant physical slots per MoE layer (expert_slots); each rank reads
    only the experts its slots hold. EPLB's controller (eplb.EplbController) later moves them.

    experts_backend / attention_backend: "auto" | "torch" | "cpu" | "triton" (| "deepgemm" for experts),
    resolved here for `device` (moe/backend.py, attention_mla/paged_decode.py) and given to the model's
    constructor; model.backends records what was chosen. With an fp8 checkpoint, a kernel experts
    backend (triton, deepgemm) keeps the routed experts and the attention/MLP projections fp8 on the
    device (Triton W8A16 linears). dispatch_options: extra make_dispatcher keywords (low-latency
    thresholds, the simulated link). kv_cache_dtype: "auto" | "fp8" | "fp4" (attention_mla/fp8_cache.py,
    fp4_cache.py): what the attention layers write to and read from the latent cache.

    quantization (QUANTIZATION; what an fp8 checkpoint's weights are in memory, docs/kernels.md): "auto" keeps
    them fp8 where the experts backend computes on fp8 (cpu, triton, deepgemm) and dequantises them at load
    into `dtype` elsewhere; "fp8" keeps them fp8 or raises saying why it cannot, and quantises an unquantised
    (bfloat16 / float32) checkpoint at load into that format (vLLM's online FP8: the projections DeepSeek's fp8
    checkpoints quantise and the routed and shared experts, e4m3 in 128 x 128 tiles with a float32 scale each;
    kv_b_proj, the router, norms, embeddings and head stay in `dtype`); "none" dequantises at load
    whatever the backend (the float32 / bfloat16 model of the same weights). The checkpoint's
    quantization_config says whether it is fp8 (vLLM's and SGLang's `quantization` detect it the same way).
    DeepSeek-V4 (engine/model/v4_family.py): its FP8 linears are dequantised at load; its FP4 routed experts stay
    packed (half a byte a weight + an e8m0 byte per 32) under "auto" and "fp4" where the cpu experts kernel reads
    them, "fp4" raising where it cannot; "none" dequantises them.

    The per-op kernels (layers/kernels.py) are the CPU backend's when either backend resolved to "cpu"
    (cpu/kernels.py), with its decode plan (engine/model/fused_decode.py; fuse_decode_stack: its whole-stack
    call); torch ops otherwise.

    The engine loads through the family (ModelFamily.load), which also builds the MTP drafter's layer when
    speculative decoding asks for it."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    loaded = family_of(cfg).build(model_dir, dtype, device, progress, ctx, dispatch_backend,
                                  num_redundant_experts=num_redundant_experts, eplb=eplb,
                                  experts_backend=experts_backend, attention_backend=attention_backend,
                                  dispatch_options=dispatch_options, kv_cache_dtype=kv_cache_dtype,
                                  fuse_decode_stack=fuse_decode_stack, quantization=quantization)
    return loaded.model
