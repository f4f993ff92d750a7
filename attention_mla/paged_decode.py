"""Absorbed-form MLA decode over the paged latent cache: the torch reference and the backend choice.

Legend: B decode sequences (one query token each), N heads, C kv_lora_rank, R rope dim,
D = C + R latent width, S cache slots, M max blocks per sequence.
Query b (already absorbed: [q_nope W_UK, q_pe]) attends over the first seq_lens[b] latents of its
sequence; keys are the whole latent [C+R], values its first C channels. The output stays in the
latent space ([B, N, C]); MLA applies W_UV and o_proj afterwards.
"""
from __future__ import annotations

import torch

from wideep.parallel.device import triton_unusable

from .kv_cache import gather_reference

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def paged_decode_reference(q: torch.Tensor, kv_pool: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: list[int], block_size: int, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """q [B, N, D], kv_pool [S, D], block_table [B, M] -> [B, N, C] (fp32 softmax), one sequence at a time."""
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for b, L in enumerate(seq_lens):
        nblk = -(-L // block_size)
        ctx = gather_reference(kv_pool, block_table[b, :nblk].tolist(), L, block_size)  # [L, D]
        p = ((q[b].float() @ ctx.float().t()) * scale).softmax(-1)                     # [N, L]
        out[b] = (p @ ctx[:, :kv_lora_rank].float()).to(q.dtype)
    return out


def resolve_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """auto: triton on CUDA when triton imports; on CPU the C kernel (the CPU backend's mla_decode) for a
    float32 model when it builds; torch otherwise (interpreted Triton on CPU is far too slow to serve).
    triton on CPU needs TRITON_INTERPRET=1 set before start (tests)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not one of {ATTENTION_BACKENDS}")
    dev = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "cpu" or (name == "auto" and dev.type == "cpu"):
        from wideep.cpu.build import unusable_for
        why = unusable_for(dev, dtype)
        if name == "cpu" and why is not None:
            raise ValueError(f"attention_backend 'cpu' is not usable: {why}")
        return "cpu" if why is None else "torch"
    reason = triton_unusable(dev)
    if name == "auto":
        return "triton" if reason is None and dev.type == "cuda" else "torch"
    if reason is not None:
        raise ValueError(f"attention_backend 'triton' is not usable: {reason}")
    return "triton"
