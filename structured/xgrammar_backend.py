"""xgrammar (https://github.com/mlc-ai/xgrammar) behind structured/backend.py's interface: the default
backend, as in vLLM and SGLang. Runs on the CPU; the bitmask is applied on the logits' device.

The tokenizer is described to xgrammar from the checkpoint's tokenizer.json alone: each id's token
string (special added tokens as "", which xgrammar never allows inside constrained text) and how
strings map to bytes (the decoder: GPT-2 byte-level, SentencePiece byte fallback, or raw).

JSON schemas and structural tags are converted to xgrammar's EBNF first and compiled from it, so that
structured/json_strings.py can make every string strict JSON (xgrammar 0.2.9's length-bounded strings
admit raw control characters) and refuse what xgrammar would silently get wrong.
"""
from __future__ import annotations

import json
import os
import re

import torch
import xgrammar as xgr

from .backend import special_token_ids
from .json_strings import length_conflicts, strict_schema, strict_strings
from .params import StructuredOutputsParams

ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # "[00:44:01] /project/cpp/x.cc:94: " before xgrammar's text


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """tokenizer: a tokenizers.Tokenizer; vocab_size: the model's logits width (>= the tokenizer's)."""
    n = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
    encoded = [""] * n
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        encoded[i] = text
    for i in special_token_ids(tokenizer):
        encoded[i] = ""
    vocab_type, prefix_space = _vocab_type(json.loads(tokenizer.to_str()).get("decoder"))
    return xgr.TokenizerInfo(encoded[:vocab_size], vocab_type, vocab_size=vocab_size, stop_token_ids=[],
                             add_prefix_space=prefix_space)


def _vocab_type(decoder: dict | None) -> tuple[xgr.VocabType, bool]:
    """tokenizer.json's decoder -> (how token strings encode bytes, whether a space is prepended)."""
    parts = decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder or {}]
    types = {d.get("type") for d in parts}
    prefix = any(d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never" for d in parts)
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in types:
        return xgr.VocabType.BYTE_FALLBACK, prefix
    return xgr.VocabType.RAW, prefix


def _ebnf_choice(options: tuple[str, ...]) -> str:
    """root ::= "a" | "b": each option a string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


class XGrammarMatcher:
    __slots__ = ("m",)

    def __init__(self, m: xgr.GrammarMatcher):
        self.m = m

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()

    def accept_prefix(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and not self.m.is_terminated() and self.m.accept_token(tokens[n]):
            n += 1   # a refused token leaves xgrammar's state as it was
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, threads: int = 2):
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        # xgrammar's own cache is off: structured/compiler.py keeps one per (backend, spec)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=min(threads, os.cpu_count() or 1),
                                            cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):   # json_object: an object (xgrammar's builtin JSON is any value)
                schema = json.loads(spec.json if kind == "json" else ANY_OBJECT)
                bad = length_conflicts(schema)
                if bad:
                    raise ValueError(f"{bad[0]}: a string with minLength/maxLength and a pattern or format is not "
                                     f"supported by xgrammar (it would ignore the length); put the length into the "
                                     f"pattern or use --structured-outputs-backend guidance")
                return self._strict(xgr.Grammar.from_json_schema(json.dumps(strict_schema(schema)),
                                                                  any_whitespace=not spec.disable_any_whitespace))
            if kind == "structural_tag":
                return self._strict(xgr.Grammar.from_structural_tag(spec.structural_tag))
            if kind == "regex":
                return self.compiler.compile_regex(spec.regex)   # its own regex path has no such quirk
            if kind == "choice":
                return self.compiler.compile_grammar(_ebnf_choice(spec.choice))
            return self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            msg = _LOCATION.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise ValueError(f"structured_outputs.{kind} does not compile: {msg}") from None

    def _strict(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        ebnf, fixed = strict_strings(str(grammar))
        return self.compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf) if fixed else grammar)

    def matcher(self, grammar: xgr.CompiledGrammar, stop_ids: list[int]) -> XGrammarMatcher:
        if stop_ids:
            return XGrammarMatcher(xgr.GrammarMatcher(grammar, override_stop_tokens=list(stop_ids)))
        # the tokenizer info names no stop token (tokenizer_info): none here either
        return XGrammarMatcher(xgr.GrammarMatcher(grammar, terminate_without_stop_token=True))

    def fill(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor) -> None:
        # one call per row: at batch 64 xgrammar's BatchGrammarMatcher thread pool cost more than it saved
        for i, m in enumerate(matchers):
            m.m.fill_next_token_bitmask(bitmask, i)
