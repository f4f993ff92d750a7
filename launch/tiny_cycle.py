"""A tiny checkpoint whose greedy continuation is known in advance: token t is followed by cycle(t), a
fixed permutation of the vocabulary made of cycles of `period` tokens. Speculative decoding's tests
and bench/speculative.py use it where drafts must be right (n-gram lookup on text that repeats).

How: a random tiny checkpoint (launch/tiny.py), then lm_head row v := the embedding of cycle^-1(v)
(times `gain`), and every layer's output projections (attention o_proj, MLP/expert down_proj) scaled
by `mix`. The residual stream stays close to the current token's embedding, so the logits peak at
cycle(t); the layers still run (attention over the paged cache, routing, experts) and, with a larger
`mix`, perturb the argmax at some positions, which makes acceptance partial instead of perfect.
"""
from __future__ import annotations

import os

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


def make_cycle_checkpoint(out_dir: str, period: int = 16, mix: float = 0.02, gain: float = 1.0, seed: int = 0,
                          **overrides) -> tuple[str, list[int]]:
    """-> (the checkpoint directory, nxt [V] as cycle_of gives it). overrides: launch/tiny.tiny_config's."""
    from safetensors.torch import load_file, save_file

    from .tiny import make_tiny_checkpoint
    make_tiny_checkpoint(out_dir, arch="v3", seed=seed, **overrides)
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    emb = t["model.embed_tokens.weight"]
    nxt = cycle_of(emb.shape[0], period, seed)
    prev = [0] * len(nxt)
    for a, b in enumerate(nxt):
        prev[b] = a
    t["lm_head.weight"] = (emb[prev] * gain).contiguous()
    for name in list(t):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = (t[name] * mix).contiguous()
    save_file(t, path, metadata={"format": "pt"})
    return out_dir, nxt
