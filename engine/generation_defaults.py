"""The checkpoint's sampling defaults (generation_config.json), applied as vLLM applies them: they
replace SamplingParams' own defaults for the fields a request leaves unset. The Python API uses
them when generate() gets no SamplingParams (vLLM's LLM.get_default_sampling_params); the HTTP
layer uses them for the fields absent from the request body (launch/server/openai_api.parse_completion).
A SamplingParams built by hand keeps what it says: there "unset" and "the default" are the same."""
from __future__ import annotations

import json
import math
import os

# generation_config.json key -> SamplingParams field: vLLM's list, minus max_new_tokens (wideep's
# max_tokens default is the request's own, as in the OpenAI API)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty"}


def generation_defaults(model_dir: str) -> dict:
    """-> {SamplingParams field: value} from model_dir/generation_config.json ({} without one).
    Only numbers are taken; a checkpoint with do_sample false still gets its temperature, as in vLLM."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    out = {}
    for key, name in FIELDS.items():
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[name] = int(v) if name == "top_k" else float(v)
    return out
