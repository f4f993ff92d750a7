"""A DeepSeek decoder step as overlap operations (see schedule.py), one state per microbatch.

State keys: ids [T], meta (AttnMeta), pools (per-layer latent pools), dispatcher (this microbatch's:
its own process group and communication thread), x [T, H] (in/out), plus per-layer scratch.
Per MoE layer: attention and routing, dispatch started | shared experts, dispatch landed -> local
experts, combine started | combine landed -> residual. Dense layers have no YIELD.
"""
from __future__ import annotations

from .schedule import YIELD


def build_ops(model) -> list:
    ops: list = [_embed(model)]
    for layer in model.model.layers:
        ops.append(_attn(layer))
        if layer.is_moe:
            ops += [_route(layer), _dispatch_start(layer), YIELD, _experts(layer), YIELD, _finish(layer)]
        else:
            ops.append(_dense(layer))
    ops.append(_final_norm(model))
    return ops


def _embed(model):
    def op(s):
        s["x"] = model.model.embed_tokens(s["ids"])
        meta = s["meta"]
        max_pos = max(meta.ctx_lens) - 1 if meta.ctx_lens else 0
        s["cos"], s["sin"] = model.rope.cos_sin(meta.positions, max_position=max_pos)
        s["layer"] = 0
    return op


def _attn(layer):
    def op(s):
        x = s["x"]
        h = x + layer.self_attn(layer.input_layernorm(x), s["meta"], s["pools"][s["layer"]], s["cos"], s["sin"])
        s["h"], s["y"] = h, layer.post_attention_layernorm(h)
    return op


def _dense(layer):
    def op(s):
        s["x"] = s["h"] + layer.mlp(s["y"])
        s["layer"] += 1
    return op


def _route(layer):
    def op(s):
        s["topk_ids"], s["topk_weights"] = layer.mlp.route(s["y"])   # physical ids
    return op


def _dispatch_start(layer):
    def op(s):
        s["pending"] = s["dispatcher"].dispatch_start(s["y"], s["topk_ids"], s["topk_weights"])
    return op


def _experts(layer):
    def op(s):
        moe = layer.mlp
        # shared experts first: they fill the time the dispatch may still need
        s["shared"] = moe.shared_experts(s["y"]) if moe.shared_experts is not None else None
        d = s["pending"].wait()
        s["pending"] = s["dispatcher"].combine_start(moe.experts(d.x, d.topk_ids, d.topk_weights), d.handle)
    return op


def _finish(layer):
    def op(s):
        out = s.pop("pending").wait()
        if s["shared"] is not None:
            out = out + s["shared"]
        s["x"] = s["h"] + out
        s["layer"] += 1
    return op


def _final_norm(model):
    def op(s):
        s["x"] = model.model.norm(s["x"])
    return op
