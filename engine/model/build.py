"""Build a model on this rank: config, expert shard, dispatcher, weights (only this rank's experts). What every
family's builder shares (dtypes, the quantization choice, the experts' placement and shard, the dispatcher) is here;
each family builds its own model (engine/model/mla_family.py, v4_family.py) behind load_model."""
from __future__ import annotations

import dataclasses

import torch

from wideep.eplb.config import EplbConfig
from wideep.eplb.placement import Placement
from wideep.moe.backend import ExpertsChoice
from wideep.moe.fp8_linear import Fp8Linear
from wideep.moe.layer import ExpertShard
from wideep.parallel.context import ParallelContext
from wideep.parallel.dispatch import make_dispatcher

from .model import _skip_init
from .model_config import ModelConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {sorted(DTYPES)})")
    return DTYPES[dtype]


QUANTIZATION = ("auto", "fp8", "fp4", "none")
# quantization "fp8" on an unquantised checkpoint: its projections and experts quantised at load in DeepSeek's tiles
ONLINE_FP8_BLOCK = (128, 128)


def _apply_quantization(quantization: str, experts: ExpertsChoice, fp8_block, online: bool = False) -> ExpertsChoice:
    """The experts choice with keep_fp8 as `quantization` asks (load_model's docstring says what each means).
    online: the checkpoint is unquantised and "fp8" quantises it at load (fp8_block: ONLINE_FP8_BLOCK)."""
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
            raise ValueError(f"quantization 'fp8'{' (quantised at load)' if online else ''}: the experts backend "
                             f"{experts.backend!r} computes on dequantised weights (fp8 is kept by cpu, triton and "
                             f"deepgemm; the block along K, {fp8_block[1]}, must be a multiple of 16)")
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


def expert_slots(cfg: ModelConfig, ctx: ParallelContext | None, eplb, num_redundant_experts: int,
                 num_layers: int) -> tuple[Placement, ExpertShard | None]:
    """The routed experts' physical slots on this rank: (the placement of `num_layers` MoE layers over
    n_routed_experts + redundant slots: eplb.initial_placement's file or slot p -> expert p % E; this rank's shard,
    None on one EP rank without redundant slots). Redundant: eplb.num_redundant_experts or num_redundant_experts
    (ParallelConfig's)."""
    eplb = EplbConfig.coerce(eplb)
    ep_rank, ep_size = (ctx.ep_rank, ctx.ep_size) if ctx is not None else (0, 1)
    E = cfg.moe.n_routed_experts
    num_physical = E + eplb.validate(ep_size, E, num_redundant_experts)
    placement = (Placement.load(eplb.initial_placement, num_layers, E, num_physical) if eplb.initial_placement
                 else Placement.initial(num_layers, E, num_physical))
    shard = ExpertShard(num_physical, ep_rank, ep_size) if ep_size > 1 or num_physical != E else None
    return placement, shard


def make_model_dispatcher(cfg: ModelConfig, ctx: ParallelContext | None, placement: Placement | None, device,
                          backend: str, dtype: torch.dtype, options: dict | None = None):
    """The MoE layers' dispatcher over ctx's EP group (one EP rank: the LocalDispatcher, so the layers have one path
    whatever the EP size); None for a model without routed experts. options: make_dispatcher's extra keywords
    (low-latency thresholds, the simulated link)."""
    if placement is None:
        return None
    return make_dispatcher(ctx or ParallelContext.single(device), placement.num_physical, cfg.hidden_size, backend,
                           dtype=dtype, **(options or {}))
