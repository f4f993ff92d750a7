"""Start-up agreement: every rank must run the same config and model, or none runs.

A rank that got a different config file would otherwise route tokens to experts the others do not
have and hang in an all-to-all. Each rank hashes a canonical string and all ranks compare hashes;
a mismatch raises the same RuntimeError on every rank.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from .watchdog import guard_collective


def fingerprint(obj: Any) -> str:
    """Canonical JSON of a config-like object (dicts in key order; other objects by str)."""
    return json.dumps(obj, sort_keys=True, default=str)


def check_agreement(ctx, fingerprint: str, what: str) -> None:
    """Raise RuntimeError on every rank unless every rank passed the same fingerprint.

    Collective over ctx.cpu_group; what names the thing compared ("model config", ...).
    """
    if ctx.is_single:
        return
    digest = torch.frombuffer(bytearray(hashlib.sha256(fingerprint.encode()).digest()), dtype=torch.uint8)
    gathered = [torch.empty_like(digest) for _ in range(ctx.world_size)]
    with guard_collective(ctx):
        dist.all_gather(gathered, digest, group=ctx.cpu_group)
    hexes = [bytes(h.tolist()).hex()[:12] for h in gathered]
    bad = [r for r in range(ctx.world_size) if hexes[r] != hexes[0]]
    if bad:
        raise RuntimeError(
            f"config mismatch: ranks {bad} have a different {what} than rank 0 (sha256 prefixes: "
            + ", ".join(f"rank {r} {h}" for r, h in enumerate(hexes))
            + f"); start every rank with the same {what}")
