"""Strict JSON strings whatever xgrammar 0.2.9 compiles: every json_schema / json_object output must parse with a
strict JSON parser and validate against its schema.

Two quirks of xgrammar 0.2.9's JSON-schema converter, and what is done about them:

- A string with minLength / maxLength (and no pattern or format) becomes a rule
  `X_characters ::= (([^\\"\\\\\\r\\n]))` repeated {min, max}: it admits the raw control characters U+0000-U+001F
  (but \\r and \\n), which JSON forbids inside strings (`"a\\x07b"`: Python's json.loads refuses it), and no
  escape at all. strict_strings rewrites each such rule to what a JSON string character is: any character but
  the control characters, `"` and `\\`, or an escape (a `\\u` escape of a surrogate half excluded, so one
  escape is one character and the length bounds hold on the decoded string).
- A string with a pattern or a format *and* minLength / maxLength: xgrammar ignores the length bounds (a
  warning on stderr), so an output could break them. length_conflicts finds such strings, and the backend
  refuses the schema (a 400 naming the string) rather than let an invalid output through.
"""
from __future__ import annotations

import re

ESCAPE_RULE = "wideep_json_escape"
_CHARS = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_STRICT = r'{} ::= (([^\0-\x1f\"\\]) | ("\\" ' + ESCAPE_RULE + '))'
_ESCAPE = (ESCAPE_RULE + r' ::= (([\"\\/bfnrt]) | ("u" [0-9A-Ca-cEeFf] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f])'
           r' | ("u" [Dd] [0-7] [0-9A-Fa-f] [0-9A-Fa-f]))')


def strict_strings(ebnf: str) -> tuple[str, int]:
    """xgrammar's EBNF of a schema -> (the EBNF with every length-bounded string's character rule strict, how
    many rules were rewritten)."""
    fixed, n = _CHARS.subn(lambda m: _STRICT.format(m.group(1)), ebnf)
    return (fixed + "\n" + _ESCAPE + "\n", n) if n else (ebnf, 0)


def length_conflicts(schema, where: str = "schema") -> list[str]:
    """The places (JSON-pointer-ish) of string schemas with minLength/maxLength beside a pattern or format."""
    found = []
    if isinstance(schema, dict):
        bounded = any(isinstance(schema.get(k), int) for k in ("minLength", "maxLength"))
        if bounded and (isinstance(schema.get("pattern"), str) or isinstance(schema.get("format"), str)):
            found.append(where)
        for k, v in schema.items():
            found += length_conflicts(v, f"{where}.{k}")
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            found += length_conflicts(v, f"{where}[{i}]")
    return found
