"""Text a JSON body may carry but no tokenizer can take: JSON's `\\udcff` escapes decode to lone UTF-16
surrogates, which are not Unicode scalar values (UTF-8 cannot encode them), so a request holding one
is a 400 naming the field instead of a tokenizer's UnicodeEncodeError (a 500)."""
from __future__ import annotations

import re

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")   # json.loads already joins valid high+low pairs


def lone_surrogate(body) -> str | None:
    """-> the path of the first string (key or value) holding an unpaired surrogate, e.g.
    "prompt" or "messages[1].content"; None when there is none. Iterative: a body nested to the
    parser's limit is walked without recursion."""
    stack = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _LONE_SURROGATE.search(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):   # reversed: the first field is reported first
                if _LONE_SURROGATE.search(k):
                    shown = ascii(k)[1:-1]   # the escape, not the unencodable character
                    return f"{path}.{shown}" if path else shown
                stack.append((f"{path}.{k}" if path else k, x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def surrogate_message(field: str) -> str:
    return f"'{field}' holds an unpaired UTF-16 surrogate (not valid Unicode text)"
