"""Build a model on this rank: config, expert shard, dispatcher, weights (only this rank's experts)."""
from __future__ import annotations

import torch

from moe.layer import ExpertShard
from parallel.context import ParallelContext

from .config import ModelConfig
from .loader import CheckpointReader, expert_ignore, load_weights
from .model import DeepseekModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {sorted(DTYPES)})")
    return DTYPES[dtype]


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True, ctx: ParallelContext | None = None, dispatch_backend: str = "auto",
               cfg: ModelConfig | None = None) -> DeepseekModel:
    """Single process when ctx is None or has ep_size 1; otherwise this rank's expert slice plus
    everything replicated, with a dispatcher for the MoE all-to-all."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    shard, dispatcher = None, None
    if ctx is not None and ctx.ep_size > 1 and cfg.moe is not None:
        from parallel.dispatch import make_dispatcher
        num_physical = cfg.moe.n_routed_experts
        shard = ExpertShard(num_physical, ctx.ep_rank, ctx.ep_size)
        dispatcher = make_dispatcher(ctx, num_physical, cfg.hidden_size, dispatch_backend, dtype=dtype)
    model = DeepseekModel(cfg, device=device, dtype=dtype, shard=shard, dispatcher=dispatcher)
    model.load_report = load_weights(CheckpointReader(model_dir), model.checkpoint_targets(),
                                     ignore=expert_ignore(model.owns_expert),
                                     num_hidden_layers=cfg.num_hidden_layers, progress=progress)
    return model.eval()
