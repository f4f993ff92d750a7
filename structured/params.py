"""StructuredOutputsParams: what a request's output must match, as vLLM spells it.

Exactly one of json (a JSON Schema: a dict, or its JSON text), regex, choice (a list of strings:
the output is one of them), grammar (EBNF, in the backend's dialect: xgrammar's GBNF-like EBNF,
llguidance's Lark), json_object (any JSON object, OpenAI's response_format "json_object") or
structural_tag (xgrammar's structural-tag JSON, vLLM's field: e.g. a model's own tool-call block).
disable_any_whitespace: JSON without free whitespace between tokens (vLLM's option).

after_token (set by the server, not a request field): the grammar applies from the token after the first
`after_token` in the output (the end of the reasoning, `</think>`); until then the output is free. None: from
the first token. It is not part of the compiled grammar (key).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SPEC_CHARS = 1 << 20   # a schema / grammar text above this is refused before anything compiles it


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    after_token: int | None = None

    def __post_init__(self):
        if self.json_object is False:   # vLLM's body may send it false beside the field it means
            object.__setattr__(self, "json_object", None)
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {list(KINDS)}, got "
                             f"{given or 'none'}")
        if self.json is not None:
            text = self.json
            if isinstance(text, dict):
                try:
                    text = json.dumps(text)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"structured_outputs.json is not JSON-serialisable: {e}") from None
            elif isinstance(text, str):
                try:
                    schema = json.loads(text)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"structured_outputs.json must be a JSON Schema object, got "
                                     f"{type(schema).__name__}")
                text = json.dumps(schema)
            else:
                raise ValueError(f"structured_outputs.json must be a JSON Schema (an object or its JSON text), "
                                 f"got {type(text).__name__}")
            object.__setattr__(self, "json", text)   # one spelling: equal schemas share a cache entry (key order kept: it is the output order)
        if self.structural_tag is not None:
            tag = self.structural_tag
            try:
                tag = json.loads(tag) if isinstance(tag, str) else tag
            except ValueError as e:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
            if not isinstance(tag, dict):
                raise ValueError(f"structured_outputs.structural_tag must be an object (xgrammar's structural tag) "
                                 f"or its JSON text, got {type(tag).__name__}")
            object.__setattr__(self, "structural_tag", json.dumps(tag, ensure_ascii=False))
        if self.after_token is not None and (isinstance(self.after_token, bool) or not isinstance(self.after_token, int)):
            raise ValueError(f"structured_outputs.after_token must be a token id, got {self.after_token!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}"[:200])
        if self.choice is not None:
            c = self.choice
            if (not isinstance(c, (list, tuple)) or not c
                    or not all(isinstance(s, str) and s for s in c)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {c!r}"[:200])
            object.__setattr__(self, "choice", tuple(c))
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be true or false, "
                             f"got {self.disable_any_whitespace!r}")
        if len(self.text) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is {len(self.text)} characters; at most "
                             f"{MAX_SPEC_CHARS} are allowed")

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """A StructuredOutputsParams, a dict of its fields (vLLM's JSON body), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object with one of {list(KINDS)}, "
                             f"got {type(value).__name__}")
        known = {*KINDS, "disable_any_whitespace"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown} (known: {sorted(known)})")
        return cls(**{k: v for k, v in value.items() if v is not None})

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The spec as one string (a choice list as JSON)."""
        v = getattr(self, self.kind)
        return json.dumps(list(v)) if self.kind == "choice" else ("" if v is True else v)

    @property
    def key(self) -> tuple:
        """The compile cache's key (with the backend and tokenizer, which the cache itself is for)."""
        return (self.kind, self.text, self.disable_any_whitespace)
