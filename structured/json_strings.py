"""Strict JSON strings whatever xgrammar 0.2.9 compiles: every json_schema / json_object output must parse with a
strict JSON parser and validate against its schema.

Two quirks of xgrammar 0.2.9's JSON-schema converter, and what is done about them:

- A string with minLength / maxLength (and no pattern or format) is built from the character class
  `[^\\"\\\\\\r\\n]` (in a rule `X_characters` repeated {min, max}, or inline for the shortest bounds): it admits
  the raw control characters U+0000-U+001F (but \\r and \\n), which JSON forbids inside strings (`"a\\x07b"`:
  Python's json.loads refuses it), and no escape at all. strict_strings replaces every use of that class by a
  rule for what a JSON string character is: any character but the control characters, `"` and `\\`, or an
  escape (a `\\u` escape of a surrogate half excluded, so one escape is one character and the length bounds
  hold on the decoded string). The class appears nowhere else in xgrammar's JSON grammars (its unbounded
  strings exclude the control characters themselves).
- Its character classes take a surrogate code point's three UTF-8 bytes (ED A0..BF xx), which is no UTF-8: the
  text then holds three U+FFFD for one character, so a length bound breaks. The strict character excludes
  U+D800-U+DFFF, and so does the length-bounded raw string of DeepSeek's DSML parameters
  (`[\\0-\\U0010ffff]`, the structural tags' "deepseek_xml" style).
- A string with a pattern or a format *and* minLength / maxLength: xgrammar ignores the length bounds (a
  warning on stderr), so an output could break them. length_conflicts finds such strings, and the backend
  refuses the schema (a 400 naming the string) rather than let an invalid output through.
- Formats: xgrammar's "date" (and the date of "date-time") takes any day 01-31 in any month ("2024-04-31") and
  its "ipv4" octets with leading zeros ("070.1.2.3"), which validators refuse. strict_schema gives those
  strings a pattern of exactly the valid values instead (leap years included; years 0001-9999).
- Patterns (a schema's, not a bare regex's): an optional group holding a repetition, `a(x[0-9]{1,3})?Z`, also
  takes the repetition without the group's start ("a00Z"); `(...){0,1}` is compiled right, so strict_schema
  writes every group's `?` so.
"""
from __future__ import annotations

CHAR_RULE, ESCAPE_RULE = "wideep_json_char", "wideep_json_escape"
LAX_CLASS = r'[^\"\\\r\n]'    # as xgrammar 0.2.9 prints it
ANY_CHAR, ANY_SCALAR = r'[\0-\U0010ffff]', r'[\0-\ud7ff\ue000-\U0010ffff]'   # DSML raw strings: no surrogates
_RULES = (CHAR_RULE + r' ::= (([^\0-\x1f\"\\\ud800-\udfff]) | ("\\" ' + ESCAPE_RULE + '))\n' +
          ESCAPE_RULE + r' ::= (([\"\\/bfnrt]) | ("u" [0-9A-Ca-cEeFf] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f])'
          r' | ("u" [Dd] [0-7] [0-9A-Fa-f] [0-9A-Fa-f]))' + '\n')


def strict_strings(ebnf: str) -> tuple[str, int]:
    """xgrammar's EBNF of a schema or structural tag -> (the EBNF with every length-bounded string's characters
    strict JSON and no surrogate in a raw one, how many classes were replaced)."""
    n, m = ebnf.count(LAX_CLASS), ebnf.count(ANY_CHAR)
    if not n + m:
        return ebnf, 0
    ebnf = ebnf.replace(ANY_CHAR, ANY_SCALAR)
    return (ebnf.replace(LAX_CLASS, CHAR_RULE) + "\n" + _RULES if n else ebnf), n + m


_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6}){0,1}(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}$", "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$"}


def optional_groups(pattern: str) -> str:
    """pattern with every group's `?` quantifier written `{0,1}` (escapes and character classes left alone;
    a lazy `??` too)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == ")" and pattern[i + 1:i + 2] == "?" and pattern[i + 2:i + 3] not in ("?", "+"):
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def strict_schema(schema):
    """schema with every string of a FORMAT_PATTERNS format (and no pattern) given that pattern instead, and
    every pattern's optional groups written as optional_groups does."""
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in schema:
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    if isinstance(out.get("pattern"), str):
        out["pattern"] = optional_groups(out["pattern"])
    return out


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
