"""Which forward the routed experts use (`experts_backend`), decided once when the model is built.

  torch     the torch grouped forward (Experts.forward_grouped); fp8 checkpoints dequantised at load
  cpu       the CPU backend's C kernels for small batches (cpu/kernels.py): routed experts with tokens only, and the
            dense / shared / attention projections and lm_head of decode-sized steps; float32 or bfloat16 on CPU,
            built with the system C compiler at first use; big batches (prefill) stay on torch. An fp8
            checkpoint's routed experts and projections stay fp8 (read as stored, csrc/gemm_fp8.c) when the
            block along K is a multiple of 16; DeepSeek-V4's FP4 routed experts stay packed (engine/model/build.py
            V4Family._experts, csrc/gemm_fp4.c)
  triton    the fused Triton kernels (moe/triton_moe.py); fp8 weights stay fp8 on the device
  deepgemm  DeepGEMM's grouped FP8 GEMMs (moe/deepgemm.py): fp8 checkpoints, bf16, CUDA, dims % 128
  auto      CPU: cpu when the model is float32 and the kernels build, else torch (interpreted Triton is
            far too slow to serve). CUDA: deepgemm for an fp8 checkpoint when deep_gemm imports and the
            shapes fit, else triton, else torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from wideep.parallel.device import triton_unusable

EXPERTS_BACKENDS = ("auto", "torch", "cpu", "triton", "deepgemm")


@dataclass(frozen=True)
class ExpertsChoice:
    backend: str            # Experts.backend: "grouped" | "cpu" | "triton" | "deepgemm"
    keep_fp8: bool          # build the experts with fp8 weights + block scales
    keep_fp4: bool = False  # DeepSeek-V4's routed experts as stored: fp4 pairs + e8m0 scales (backend "cpu")
    deepgemm: object = None  # moe.deepgemm.DeepGemmApi when backend == "deepgemm"


def deepgemm_unusable(device: torch.device, dtype: torch.dtype, fp8_block: tuple[int, int] | None,
                      hidden: int, intermediate: int, api) -> str | None:
    if fp8_block is None:
        return "the checkpoint is not fp8 (DeepGEMM's grouped GEMMs take fp8 weights)"
    if tuple(fp8_block) != (128, 128):
        return f"weight_block_size is {list(fp8_block)}, DeepGEMM needs [128, 128]"
    if hidden % 128 or intermediate % 128:
        return f"hidden_size ({hidden}) and moe_intermediate_size ({intermediate}) must be multiples of 128"
    if dtype != torch.bfloat16:
        return f"the model dtype is {dtype}; DeepGEMM writes bf16"
    if device.type != "cuda":
        return f"the device is {device}, not CUDA"
    if api is None:
        return "deep_gemm does not import or has no grouped FP8 GEMM"
    return None


def resolve_experts_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                            fp8_block: tuple[int, int] | None, hidden: int, intermediate: int,
                            deepgemm_api=None) -> ExpertsChoice:
    """fp8_block: the checkpoint's weight_block_size when it is fp8, else None. deepgemm_api: a probed
    API (tests pass fakes); by default deep_gemm is imported when it could be chosen."""
    if name not in EXPERTS_BACKENDS:
        raise ValueError(f"experts_backend {name!r} is not one of {EXPERTS_BACKENDS}")
    dev = torch.device(device)
    if name == "cpu" or (name == "auto" and dev.type != "cuda"):
        from wideep.cpu.build import unusable_for
        why_not_cpu = unusable_for(dev, dtype)
        if name == "cpu" and why_not_cpu is not None:
            raise ValueError(f"experts_backend 'cpu' is not usable: {why_not_cpu}")
        if why_not_cpu is not None:
            return ExpertsChoice("grouped", keep_fp8=False)
        # the C kernels read fp8 blocks as stored when a block's K side is whole vectors (gemm_fp8.c)
        return ExpertsChoice("cpu", keep_fp8=fp8_block is not None and fp8_block[1] % 16 == 0)
    if name == "torch":
        return ExpertsChoice("grouped", keep_fp8=False)
    if name in ("auto", "deepgemm") and deepgemm_api is None and fp8_block is not None and dev.type == "cuda":
        from .deepgemm import load
        deepgemm_api = load()
    why_not_dg = deepgemm_unusable(dev, dtype, fp8_block, hidden, intermediate, deepgemm_api)
    if name == "deepgemm":
        if why_not_dg is not None:
            raise ValueError(f"experts_backend 'deepgemm' is not usable: {why_not_dg}")
        return ExpertsChoice("deepgemm", keep_fp8=True, deepgemm=deepgemm_api)
    why_not_triton = triton_unusable(dev)
    if name == "triton" and why_not_triton is not None:
        raise ValueError(f"experts_backend 'triton' is not usable: {why_not_triton}")
    if name == "auto" and why_not_dg is None:
        return ExpertsChoice("deepgemm", keep_fp8=True, deepgemm=deepgemm_api)
    if why_not_triton is None:
        keep = fp8_block is not None and fp8_block[1] % 16 == 0  # the kernel needs BK (>= 16) to divide it
        if name == "triton" and fp8_block is not None and not keep:
            raise ValueError(f"experts_backend 'triton' needs the fp8 block along K ({fp8_block[1]}) to be a "
                             f"multiple of 16")
        return ExpertsChoice("triton", keep_fp8=keep)
    return ExpertsChoice("grouped", keep_fp8=False)
