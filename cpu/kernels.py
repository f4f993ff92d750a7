"""The CPU backend's per-op kernels, as the table the model's modules bind at build time
(layers/kernels.py names each entry's contract; engine's builder turns this into a Kernels).
CPU tensors: the backend is chosen for float32 and bfloat16 models on the CPU (build.unusable_for); bfloat16
weights, FP8 block-quantised ones (an fp8 checkpoint kept as stored) and DeepSeek-V4's FP4 routed experts are
read as stored, activations computed in float32 and returned in their own dtype."""
from __future__ import annotations


def table() -> dict:
    """name -> kernel: every per-op kernel of the CPU backend (the fused decode halves are the decode
    plan's, engine/model/fused_decode.py, not per-op)."""
    from .gemm import bmm_nt, experts
    from .layers import hc_enter, hc_leave, mla_decode, rmsnorm, rope, route
    from .linear import Linear, experts_max_rows, small_linear, small_linear_fp8
    return {"rmsnorm": rmsnorm, "rope": rope, "linear": Linear, "matmul": small_linear, "route": route,
            "experts": experts, "experts_max_rows": experts_max_rows, "mla_decode": mla_decode, "bmm_nt": bmm_nt,
            "fp8_linear": small_linear_fp8, "hc_enter": hc_enter, "hc_leave": hc_leave}
