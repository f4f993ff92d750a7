"""llguidance (https://github.com/guidance-ai/llguidance) behind structured/backend.py's interface:
`--structured-outputs-backend guidance`, as vLLM names it. Its grammars are Lark (a GBNF/EBNF
grammar is converted), its JSON and regex its own. The tokenizer is built from tokenizer.json's text.

llguidance fixes the end-of-sequence tokens per tokenizer, so one tokenizer is kept per set of stop
tokens (EOS and stop_token_ids: a request's own set is rare beyond the checkpoint's EOS).
"""
from __future__ import annotations

import threading

import llguidance
import llguidance.torch as llgt
import torch

from .params import StructuredOutputsParams

ANY_OBJECT = '{"type": "object"}'


class GuidanceMatcher:
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher):
        self.m = m

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token) and not self.m.is_error()

    @property
    def terminated(self) -> bool:
        return self.m.is_stopped()

    def accept_prefix(self, tokens: list[int]) -> int:
        # consume_token of a refused token would leave the matcher in its error state: try_ consumes the valid prefix
        return self.m.try_consume_tokens(tokens) if not self.m.is_stopped() else 0

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.m.get_error()}")


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.json = tokenizer.to_str()
        self.tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}
        self.lock = threading.Lock()
        # validation needs a tokenizer; any stop set gives the same verdict
        self.default = self.tokenizer_for(())

    def tokenizer_for(self, stop_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        with self.lock:
            tok = self.tokenizers.get(stop_ids)
            if tok is None:
                tok = llguidance.LLTokenizer(self.json, n_vocab=self.vocab_size,
                                             eos_token=list(stop_ids) if stop_ids else None)
                self.tokenizers[stop_ids] = tok
            return tok

    def compile(self, spec: StructuredOutputsParams) -> str:
        kind = spec.kind
        if kind == "structural_tag":   # xgrammar's format; llguidance reads none of it
            raise ValueError("structured_outputs.structural_tag is not supported by --structured-outputs-backend "
                             "guidance (it is xgrammar's format, e.g. a DeepSeek model's DSML tool-call block for "
                             "tool_choice required / named); use --structured-outputs-backend xgrammar")
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec.json, defaults={"whitespace_flexible": not spec.disable_any_whitespace})
            elif kind == "json_object":
                grammar = llguidance.grammar_from("json", ANY_OBJECT)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", list(spec.choice))
            else:
                grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", getattr(spec, kind))
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None
        err = llguidance.LLMatcher.validate_grammar(grammar, self.default)
        if err:
            raise ValueError(f"structured_outputs.{kind} does not compile: {err.strip().splitlines()[0]}")
        return grammar

    def matcher(self, grammar: str, stop_ids: list[int]) -> GuidanceMatcher:
        return GuidanceMatcher(llguidance.LLMatcher(self.tokenizer_for(tuple(stop_ids)), grammar, log_level=0))

    def fill(self, matchers: list[GuidanceMatcher], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            llgt.fill_next_token_bitmask(m.m, bitmask, i)
