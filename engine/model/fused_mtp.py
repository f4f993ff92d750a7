"""The MTP layer's draft passes (mtp.py MTPLayer) as one C call, cpu/fused.py mtp_pass: pass 1's input (eh_proj of
the normed embedding and hidden state), the rows that only write their cache entries, the decoder layer as
decode_stack's one-layer call (the decode plan's extra_layer_call: its structs and LayerDesc), the head and its
argmax, then passes 2..P, each row's draft and output fed back in at its lookahead position. Between a pass's small
Python operations its weights were read from memory again (~2x the kernels' time). Reached through the decode plan
(fused_decode.py DecodePlan.mtp_fits / mtp_passes), the one place that decides what runs fused.

Legend: T rows (out rows: each its sequence's last), H hidden, P passes.
"""
from __future__ import annotations

import torch

from wideep.cpu import fused
from wideep.cpu.gemm import as_f32
from wideep.dbo.state import Microbatch
from wideep.moe.fp8_linear import Fp8Linear

from .fused_weights import WEIGHT_DTYPES
from .mtp import MTPLayer


def fits(mtp: MTPLayer) -> bool:
    """Whether the pass's own weights fit fused.mtp_pass (the layer's are the decode plan's to judge): the norms,
    eh_proj and the head bias-free CPU tensors of one dtype, float32 or bfloat16, the embeddings either."""
    ws = [mtp.enorm.weight, mtp.hnorm.weight, mtp.eh_proj.weight, mtp.norm.weight, mtp.head.weight]
    e = mtp.embed.weight
    return (ws[0].dtype in WEIGHT_DTYPES
            and all(w.dtype == ws[0].dtype and w.is_contiguous() and w.device.type == "cpu" for w in ws)
            and getattr(mtp.eh_proj, "bias", None) is None and mtp.head.bias is None
            and not isinstance(mtp.eh_proj, Fp8Linear)
            and e.dtype in WEIGHT_DTYPES and e.is_contiguous() and e.device.type == "cpu")


def passes(plan, mtp: MTPLayer, token_ids: torch.Tensor, prev: torch.Tensor, meta, kv_pools: list, step_plan,
           rows: tuple | None = None, later: tuple | None = None) -> tuple[torch.Tensor, list[list[int]], int] | None:
    """The pass (with `later`, the passes: MTPLayer.first_pass) as one fused.mtp_pass call -> (out [T, H] in prev's
    dtype, each row's drafts, passes), or None where the layer does not fuse for these rows (plan: the
    DecodePlan; then nothing was done). rows: (out_rows, rest, their slots, cos, sin) when only out_rows run the
    layer (first_pass), else every row does. later: (P, positions, slots, lengths) as first_pass takes it."""
    n_out = rows[0].shape[0] if rows is not None else token_ids.shape[0]
    mb = Microbatch(0, token_ids[:n_out], meta, kv_pools, step_plan, mtp.dispatcher)
    call = plan.extra_layer_call(mtp.layer, mb, token_ids.shape[0])
    if call is None:
        return None
    desc, w = call
    table, lens, max_len = meta.paged_decode_tables(mtp.layer.self_attn.mode)
    cos, sin = mtp.rope.cos_sin(meta.positions, max_position=max(meta.ctx_lens) - 1)
    out_rows, rest, rest_slots, rest_cos, rest_sin = rows if rows is not None else (None,) * 5
    P, more = 1, None
    if later is not None and later[0] > 1:
        P, pos, sl, ln = later
        ncos, nsin = mtp.rope.cos_sin(torch.tensor(pos, device=prev.device), max_position=max(pos))
        more = (torch.tensor(sl, device=prev.device).view(n_out, P - 1),
                torch.tensor(ln, dtype=torch.int32, device=prev.device).view(n_out, P - 1),
                ncos.contiguous().view(n_out, P - 1, -1), nsin.contiguous().view(n_out, P - 1, -1))
    out, tok = fused.mtp_pass(desc, w.mla, w.moe, w.mlp, token_ids, mtp.embed.weight,
                              (mtp.enorm.weight, mtp.enorm.eps), (mtp.hnorm.weight, mtp.hnorm.eps),
                              mtp.eh_proj.weight, as_f32(prev).contiguous(), (mtp.norm.weight, mtp.norm.eps),
                              mtp.head.weight, cos, sin, meta.slot_mapping, table, lens, max_len, meta.block_size,
                              out_rows, rest, rest_slots, rest_cos, rest_sin, more)
    drafts = [[d for d in row if d >= 0] for row in tok.tolist()]   # SYNC: drafts to the host
    if mtp.layer.is_moe:   # the rows each pass ran through the layer's MoE: those with a draft from it
        for j in range(P):
            mtp.dispatcher.account_local(sum(len(d) > j for d in drafts))
    return out.to(prev.dtype), drafts, P
