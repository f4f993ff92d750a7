"""Structured outputs: decoding constrained by a JSON schema, a regex, a choice or an EBNF grammar.

    params.py           StructuredOutputsParams (vLLM's field names), checked once, with a cache key
    backend.py          the grammar-engine interface (compile, matcher, bitmask) and the backends' names
    xgrammar_backend.py xgrammar (the default, as in vLLM and SGLang)
    guidance_backend.py llguidance (--structured-outputs-backend guidance)
    compiler.py         GrammarCompiler: a thread pool + cache by spec over one backend, one per process;
                        make_backend (a backend by name)
    rows.py             the rank's per-step part: fill the constrained rows' bitmask, apply, accept tokens

Imports nothing of wideep's other packages: engine/ uses it (SamplingParams, the rank's logits
processing), launch/ builds its specs from OpenAI's fields.
"""
from .params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
