"""A tiny checkpoint whose greedy continuation is known in advance: token t is followed by cycle(t), a
fixed permutation of the vocabulary made of cycles of `period` tokens. Speculative decoding's tests
and bench/speculative.py use it where drafts must be right (n-gram lookup on text that repeats).

How: a random tiny checkpoint (launch/tiny/checkpoint.py), then lm_head row v := the embedding of cycle^-1(v)
(times `gain`), and every layer's output projections (attention o_proj, MLP/expert down_proj) scaled
by `mix`. The residual stream stays close to the current token's embedding, so the logits peak at
cycle(t); the layers still run (attention over the paged cache, routing, experts) and, with a larger
`mix`, perturb the argmax at some positions, which makes acceptance partial instead of perfect.
"""
from __future__ import annotations

import json
import os
import random

import torch


def cycle_of(vocab_size: int, period: int, seed: int = 0) -> list[int]:
    """-> nxt [V]: nxt[t] is the token after t (tokens shuffled, then chained in cycles of `period`)."""
    if not 2 <= period <= vocab_size:
        raise ValueError(f"period must be in [2, vocab_size={vocab_size}], got {period}")
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed)).tolist()
    nxt = list(range(vocab_size))
    for start in range(0, vocab_size - vocab_size % period, period):
        ring = order[start:start + period]
        for i, t in enumerate(ring):
            nxt[t] = ring[(i + 1) % period]
    return nxt   # the last vocab % period tokens map to themselves


def cycle_prompts(nxt: list[int], n: int, length: int, seed: int = 0, noise: float = 0.1) -> list[list[int]]:
    """n prompts of `length` tokens that follow the cycle nxt (cycle_of), each token replaced by a random one
    with probability `noise` (the cycle then goes on from it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t, p = rng.randrange(len(nxt)), []
        for _ in range(length):
            p.append(t if rng.random() >= noise else rng.randrange(len(nxt)))
            t = nxt[p[-1]]
        out.append(p)
    return out


def cycle_head(emb: torch.Tensor, period: int, gain: float, seed: int) -> tuple[torch.Tensor, list[int]]:
    """The head of a cycle model: row v := the embedding of cycle^-1(v) times `gain`, so that the token t's own
    embedding scores highest at cycle(t) -> (head [V, H], nxt [V] as cycle_of gives it)."""
    nxt = cycle_of(emb.shape[0], period, seed)
    prev = [0] * len(nxt)
    for a, b in enumerate(nxt):
        prev[b] = a
    return (emb[prev] * gain).contiguous(), nxt


def make_cycle_checkpoint(out_dir: str, period: int = 16, mix: float = 0.02, gain: float = 1.0, seed: int = 0,
                          mtp: bool = False, mtp_hidden: float = 0.05, mtp_mix: float | None = None,
                          arch: str = "v3", **overrides) -> tuple[str, list[int]]:
    """-> (the checkpoint directory, nxt [V] as cycle_of gives it). overrides: launch/tiny/tiny.tiny_config's for
    `arch` ("v3", "v32": DSA's indexer in every layer, "glm4_moe_lite"; launch/tiny/checkpoint.py).

    mtp: also an MTP layer (`model.layers.{L}.*`, num_nextn_predict_layers = 1; the arch's own decoder layer, a
    MoE one, as DeepSeek-V3, V3.2 and GLM-4.x-lite publish it) built to predict
    the token after next the same way: its eh_proj passes the normed embedding of token i + 1 through (the
    identity on that half) plus `mtp_hidden` x a random map of the target's hidden state, its decoder
    layer's outputs are scaled by `mtp_mix` (default `mix`; its input is RMS-normed, so the same scale perturbs it
    more than the target's layers), and its shared head is lm_head: its argmax is then
    cycle(token i + 1), the target's own next prediction, wherever the layers' perturbation is small."""
    from safetensors.torch import load_file, save_file

    from .checkpoint import make_tiny_checkpoint, tiny_config
    if arch not in ("v3", "v32", "glm4_moe_lite"):
        raise ValueError(f"a cycle checkpoint's arch is 'v3', 'v32' or 'glm4_moe_lite', got {arch!r}")
    L = tiny_config(arch, **overrides)["num_hidden_layers"]
    make_tiny_checkpoint(out_dir, arch=arch, seed=seed, **dict(overrides, num_hidden_layers=L + mtp))
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    emb = t["model.embed_tokens.weight"]
    t["lm_head.weight"], nxt = cycle_head(emb, period, gain, seed)
    for name in list(t):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            scale = mtp_mix if mtp and mtp_mix is not None and name.startswith(f"model.layers.{L}.") else mix
            t[name] = (t[name] * scale).contiguous()
    if mtp:
        H = emb.shape[1]
        g = torch.Generator().manual_seed(seed + 1)
        pre = f"model.layers.{L}."
        t[pre + "enorm.weight"] = torch.ones(H)
        t[pre + "hnorm.weight"] = torch.ones(H)
        t[pre + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.randn(H, H, generator=g) * mtp_hidden / H ** 0.5], 1)
        t[pre + "shared_head.norm.weight"] = torch.ones(H)
        t[pre + "shared_head.head.weight"] = t["lm_head.weight"].clone()
        t[pre + "embed_tokens.weight"] = emb.clone()   # as published checkpoints carry it (not read)
        cfg_path = os.path.join(out_dir, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = L, 1
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    save_file(t, path, metadata={"format": "pt"})
    return out_dir, nxt


def make_v4_cycle_checkpoint(out_dir: str, period: int = 16, mix: float = 0.02, gain: float = 1.0, seed: int = 0,
                             mtp: bool = False, mtp_hidden: float = 0.05, mtp_mix: float | None = None,
                             **overrides) -> tuple[str, list[int]]:
    """make_cycle_checkpoint for DeepSeek-V4 (launch/tiny/v4.py, saved by transformers; overrides: its
    DeepseekV4Config fields): head row v := the embedding of cycle^-1(v) (times `gain`), and every attention's
    wo_b and every expert's w2 (shared ones too) scaled by `mix`. The hyper-connections mix residual streams that
    all start as the token's embedding, so the head still sees it: the logits peak at cycle(t) where the layers'
    perturbation is small. -> (the checkpoint directory, nxt [V]).

    mtp: also MTP block 0 in DeepSeek's names (`mtp.0.*`; transformers saves none), a sliding-window block built to
    predict the token after next the same way: its attention, MoE and hyper-connections are decoder layer 2's
    (its compressor and indexer left out), wo_b and w2 scaled by `mtp_mix` (default `mix`); e_proj is the identity
    and h_proj `mtp_hidden` x a random map, so its input is the normed embedding of token i + 1 plus a little of the
    target's streams; its norms are ones and its head the model's: its argmax is then cycle(token i + 1), the
    target's own next prediction, wherever the block's perturbation is small."""
    from safetensors.torch import load_file, save_file

    from .v4 import tiny_v4_model
    tiny_v4_model(seed, **overrides).save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    emb = t["model.embed_tokens.weight"]
    t["head.weight"], nxt = cycle_head(emb, period, gain, seed)
    for name in list(t):
        if name.endswith((".attn.wo_b.weight", ".w2.weight")):
            t[name] = (t[name] * mix).contiguous()
    if mtp:
        H, src = emb.shape[1], "model.layers.2."
        scale = mix if mtp_mix is None else mtp_mix
        for name in [n for n in t if n.startswith(src) and ".compressor." not in n and ".indexer." not in n]:
            v = t[name]
            if name.endswith((".attn.wo_b.weight", ".w2.weight")):
                v = v / mix * scale
            t["mtp.0." + name[len(src):]] = v.clone().contiguous()
        g = torch.Generator().manual_seed(seed + 1)
        t |= {"mtp.0.e_proj.weight": torch.eye(H), "mtp.0.h_proj.weight": torch.randn(H, H, generator=g) * mtp_hidden
              / H ** 0.5, "mtp.0.enorm.weight": torch.ones(H), "mtp.0.hnorm.weight": torch.ones(H),
              "mtp.0.norm.weight": torch.ones(H)}
        t |= {f"mtp.0.hc_head_{k}": t[f"model.hc_head.hc_{k}"].clone() for k in ("fn", "base", "scale")}
    save_file(t, path, metadata={"format": "pt"})
    return out_dir, nxt
