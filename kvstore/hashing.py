"""Block hashes: full blocks of a token sequence named by a chain of digests, so equal prefixes give
equal chains and a block's name says everything before it.

    h[0] = H(ROOT, tokens[0:bs]),  h[i] = H(h[i-1], tokens[i*bs:(i+1)*bs])      (bs = block_size)

H is BLAKE2b (128-bit digest) over the parent digest and the token ids as little-endian uint32: the
same on every process, machine and run (Python's hash() is salted per process), so the front can
compute a prompt's chain to route it, every rank names its blocks alike, and a disk tier written
by an earlier run is found again. The model is not in the chain: tiers keep one namespace per model
identity (kvstore/identity.py).

    >>> chain([5, 6, 7, 8, 9], block_size=2, n_blocks=2) == chain([5, 6, 7, 8], 2, 2)
    True
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

ROOT = 0
_DIGEST = 16


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The digest of one full block (an int of 128 bits), given its parent's."""
    h = hashlib.blake2b(parent.to_bytes(_DIGEST, "little"), digest_size=_DIGEST)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def chain(tokens: Sequence[int], block_size: int, n_blocks: int, known: Sequence[int] = ()) -> list[int]:
    """Hashes of the first n_blocks full blocks of tokens, extending `known` (the chain's start, already
    computed) instead of hashing those blocks again."""
    if n_blocks * block_size > len(tokens):
        raise ValueError(f"{n_blocks} blocks of {block_size} need {n_blocks * block_size} tokens, got {len(tokens)}")
    out = list(known[:n_blocks])
    parent = out[-1] if out else ROOT
    for i in range(len(out), n_blocks):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def prefix_chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chain a prompt can hit in a prefix cache: its full blocks, minus one when the prompt fills
    its last block exactly (the last token is always computed: its logits give the first output)."""
    return chain(tokens, block_size, (len(tokens) - 1) // block_size)


def hex_of(h: int) -> str:
    return h.to_bytes(_DIGEST, "little").hex()


def from_hex(s: str) -> int:
    """The inverse of hex_of; ValueError for anything that is not one."""
    if len(s) != 2 * _DIGEST:
        raise ValueError(f"not a block hash: {s!r}")
    return int.from_bytes(bytes.fromhex(s), "little")
