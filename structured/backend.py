"""The grammar-engine interface: a backend compiles a spec once (per tokenizer) and makes one matcher
per constrained sequence; a step fills a token bitmask for the constrained rows and applies it.

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


class Backend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """-> the compiled grammar; ValueError naming the problem for a bad schema / regex / grammar."""

    def matcher(self, grammar: Any, stop_ids: list[int]) -> Matcher:
        """stop_ids: the tokens that end the sequence (EOS, stop_token_ids), allowed only where the
        grammar may end; none: the matcher terminates when the grammar completes."""

    def bitmask(self, rows: int) -> torch.Tensor:
        """-> [rows, W] int32 on the host, every bit set."""

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """Row i of bitmask [R, W] <- matchers[i]'s allowed next tokens."""

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """logits [B, V] (any device) in place: row rows[i] masked by bitmask[i] (-inf where not allowed)."""


def make_backend(name: str, tokenizer, vocab_size: int) -> Backend:
    """tokenizer: the checkpoint's tokenizers.Tokenizer; vocab_size: the model's logits width."""
    if name == "xgrammar":
        from .xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size)
    if name == "guidance":
        from .guidance_backend import GuidanceBackend
        return GuidanceBackend(tokenizer, vocab_size)
    raise ValueError(f"structured outputs backend must be one of {list(BACKENDS)}, got {name!r}")


def special_token_ids(tokenizer) -> set[int]:
    """The tokenizer's special added tokens (BOS, EOS, chat markup): never part of constrained text."""
    return {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
