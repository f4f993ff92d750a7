"""The checkpoint's generation_config.json sampling defaults, as vLLM applies them: for generate()
without SamplingParams, and for the HTTP fields a request leaves out."""
from __future__ import annotations

import json
import os

from wideep.engine import LLM
from wideep.engine.generation_defaults import generation_defaults
from wideep.launch.server.openai_api import parse_completion
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint


def _checkpoint(tmp_path, **gen):
    d = make_tiny_checkpoint(str(tmp_path), arch="v3", seed=2, initializer_range=0.2)
    path = os.path.join(d, "generation_config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, **gen}, f)
    return d


def test_defaults_read_and_filtered(tmp_path):
    d = _checkpoint(tmp_path, temperature=0.6, top_p=0.95, top_k=20.0, do_sample=True, max_new_tokens=9,
                    min_p="bad")
    assert generation_defaults(d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(str(tmp_path / "nowhere")) == {}


def test_http_fills_only_absent_fields(tmp_path):
    d = generation_defaults(_checkpoint(tmp_path, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1))
    p = parse_completion({"prompt": [1, 2]}, "m", defaults=d).params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    p = parse_completion({"prompt": [1, 2], "temperature": 0, "top_k": -1, "top_p": None,
                          "repetition_penalty": 1.0}, "m", defaults=d).params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.95, -1, 1.0)
    p = parse_completion({"prompt": [1, 2]}, "m").params
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, -1)


def test_generate_without_params_uses_them(tmp_path):
    llm = LLM(_checkpoint(tmp_path, temperature=0.0), progress=False)
    sp = llm.get_default_sampling_params()
    assert sp.temperature == 0.0 and sp.greedy
    sp.max_tokens, sp.ignore_eos = 16, False
    assert llm.generate([[5, 9, 77]])[0].outputs[0].token_ids == llm.generate([[5, 9, 77]], sp)[0].outputs[0].token_ids
