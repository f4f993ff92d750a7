"""The grammar-engine interface: a backend compiles a spec once (per tokenizer), makes one matcher per
constrained sequence and fills a token bitmask for the constrained rows; the bitmask format is the
one xgrammar and llguidance share, so allocating and applying it live here, once.

Legend: R constrained rows this step, W = ceil(V / 32) int32 words of bitmask per row, V vocab
(the model's logits width, which may exceed the tokenizer's vocabulary: the ids above it are never
allowed). Bit t of row r set: token t is allowed.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from .params import StructuredOutputsParams

BACKENDS = ("xgrammar", "guidance")


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar forbids it."""

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token (or, with no stop token, reached its end): nothing may follow."""

    def accept_prefix(self, tokens: list[int]) -> int:
        """Advance by the longest prefix of tokens the grammar allows (stopping at its end) -> its length;
        the state is then as if only those were accepted (speculative decoding's drafts)."""

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (speculative decoding checks drafts, then backs out)."""


class Backend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """-> the compiled grammar; ValueError naming the problem for a bad schema / regex / grammar."""

    def matcher(self, grammar: Any, stop_ids: list[int]) -> Matcher:
        """stop_ids: the tokens that end the sequence (EOS, stop_token_ids), allowed only where the
        grammar may end; none: the matcher terminates when the grammar completes."""

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """Row i of bitmask [R, W] <- matchers[i]'s allowed next tokens (the other bits cleared)."""


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """-> a host bitmask [rows, W] int32 with every bit set (every token allowed)."""
    return torch.full((rows, words(vocab_size)), -1, dtype=torch.int32)


def mask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [B, V] in place: row rows[i] set to -inf where bitmask [R, W] row i clears the token;
    the other rows untouched. Half the batch or more constrained: one masked_fill over the batch
    (the other rows' mask all clear); fewer: row by row."""
    B, V = logits.shape
    R = len(rows)
    if R * 2 >= B and R < B:
        full = allocate(B, V)
        full[rows] = bitmask
        bitmask, rows = full, list(range(B))
    refused = _unpack(~bitmask, V, logits.device)                      # [R, V] bool: not allowed
    if len(rows) == B:
        logits.masked_fill_(refused, float("-inf"))
        return
    for i, r in enumerate(rows):
        logits[r].masked_fill_(refused[i], float("-inf"))


_SHIFTS: dict = {}


def _unpack(bitmask: torch.Tensor, V: int, device) -> torch.Tensor:
    """[R, W] int32 (bit j of word w: token 32 w + j) -> [R, V] bool on `device`. On the host numpy's
    unpackbits (little-endian words viewed as bytes, bits little-first); elsewhere shifts on the device."""
    if torch.device(device).type == "cpu":
        import numpy as np
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, count=V, bitorder="little")
        return torch.from_numpy(bits).bool()
    return unpack_shifts(bitmask.to(device, non_blocking=True), V)


def unpack_shifts(words: torch.Tensor, V: int) -> torch.Tensor:
    """_unpack with torch ops on words' own device ([R, W] int32 -> [R, V] bool)."""
    dev = words.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :V].bool()


def special_token_ids(tokenizer) -> set[int]:
    """The tokenizer's special added tokens (BOS, EOS, chat markup): never part of constrained text."""
    return {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
