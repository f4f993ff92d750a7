"""Bad input raises a clear error naming the problem; the engine keeps working afterwards."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from wideep.engine import LLM, ConfigError, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=1)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, progress=False, max_model_len=128)


def _copy(src: str, dst: str, edit_tensors=None, edit_config=None) -> str:
    os.makedirs(dst, exist_ok=True)
    cfg = json.load(open(os.path.join(src, "config.json")))
    if edit_config:
        edit_config(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    t = load_file(os.path.join(src, "model.safetensors"))
    if edit_tensors:
        edit_tensors(t)
    save_file(t, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_llama_config_rejected(tiny, tmp_path):
    d = _copy(tiny, str(tmp_path / "llama"), edit_config=lambda c: c.update(architectures=["LlamaForCausalLM"],
                                                                           model_type="llama"))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        LLM(d)


@pytest.mark.parametrize("field,value,match", [
    ("topk_method", "magic", "topk_method"),
    ("scoring_func", "relu", "scoring_func"),
    ("hidden_act", "gelu", "hidden_act"),
    ("quantization_config", {"quant_method": "awq"}, "quant_method"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_type"),
    ("n_group", 3, "n_group"),
])
def test_unsupported_config_values_name_the_field(tiny, tmp_path, field, value, match):
    d = _copy(tiny, str(tmp_path / "bad"), edit_config=lambda c: c.update({field: value}))
    with pytest.raises(ConfigError, match=match):
        LLM(d)


def test_missing_tensor_named(tiny, tmp_path):
    d = _copy(tiny, str(tmp_path / "m"), edit_tensors=lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        LLM(d)


def test_wrong_shape_named(tiny, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    d = _copy(tiny, str(tmp_path / "s"), edit_tensors=lambda t: t.update({name: torch.zeros(5, 7)}))
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj.*\(64, 32\).*\(5, 7\)"):
        LLM(d)


def test_token_id_out_of_vocab(llm):
    with pytest.raises(ValueError, match="token id 256 is out of range"):
        llm.generate([[1, 2, 256]])
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[-1]])


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])


def test_max_tokens_beyond_context(llm):
    with pytest.raises(ValueError, match=r"max_tokens \(100\) exceeds the context \(max_model_len=128\)"):
        llm.generate([list(range(2, 40))], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 128])


def test_bad_sampling_params():
    for kw, match in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                      ({"max_tokens": 0}, "max_tokens"), ({"logprobs": -2}, "logprobs")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)


def test_bad_request_in_batch_accepts_nothing_and_engine_keeps_serving(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    good = llm.generate([[3, 4, 5]], sp)[0].outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.generate([[3, 4, 5], [999]], sp)
    assert not llm.engine.core.scheduler.has_work()
    assert llm.generate([[3, 4, 5]], sp)[0].outputs[0].token_ids == good
    blocks = llm.engine.core.blocks.allocators["latent"]
    assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("kw,match", [
    ({"top_k": -5}, r"top_k must be -1 or 0 \(disabled\) or >= 1, got -5"),
    ({"top_k": 2.5}, "top_k must be an int"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"temperature": float("inf")}, "temperature must be finite"),
    ({"top_p": float("nan")}, "top_p must be finite"),
    ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
    ({"prompt_logprobs": "5"}, "prompt_logprobs must be an int"),
    ({"logprobs": True}, "logprobs must be an int"),
    ({"seed": 1 << 64}, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    ({"seed": -(1 << 63) - 1}, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
    ({"stop_token_ids": "12"}, "stop_token_ids must be a list of ints"),
    ({"stop_token_ids": [1, 2.0]}, "stop_token_ids must be a list of ints"),
])
def test_sampling_params_reject_named(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sampling_params_edges_accepted():
    assert SamplingParams(top_k=0).top_k == -1          # 0 disables top-k, as in vLLM
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(seed=(1 << 64) - 1).seed == (1 << 64) - 1 and SamplingParams(seed=-(1 << 63)).seed
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-5).greedy


def test_hostile_sampling_params_run_or_are_refused_and_engine_keeps_serving(llm):
    """Each of these once passed validation and then failed inside a step, leaving the engine broken."""
    greedy = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids
    for kw, match in [({"logprobs": 10 ** 6}, r"logprobs=1000000 is more than max_logprobs=20"),
                      ({"prompt_logprobs": 21}, r"prompt_logprobs=21 is more than max_logprobs=20")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, **kw))
    # a tiny temperature is greedy (dividing by it would overflow the logits); extreme seeds work
    assert llm.generate([[3, 4, 5]], SamplingParams(temperature=1e-300, max_tokens=4))[0].outputs[0].token_ids == greedy
    for seed in ((1 << 64) - 1, -(1 << 63)):
        assert len(llm.generate([[3, 4, 5]], SamplingParams(seed=seed, max_tokens=4, ignore_eos=True))[0]
                   .outputs[0].token_ids) == 4
    (o,) = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2, logprobs=20, prompt_logprobs=20))
    assert all(len(lp) >= 20 for lp in o.outputs[0].logprobs) and all(len(lp) >= 20 for lp in o.prompt_logprobs[1:])
    assert llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids == greedy


def test_max_logprobs_option_and_vocab_cap(tiny):
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, got -1"):
        LLM(tiny, max_logprobs=-1)
    llm = LLM(tiny, progress=False, max_model_len=64, max_logprobs=1000)
    V = llm.config.vocab_size
    with pytest.raises(ValueError, match=rf"logprobs={V + 1} is more than the vocabulary \(vocab_size={V}\)"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=1, logprobs=V + 1))
    (o,) = llm.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=V))
    assert len(o.outputs[0].logprobs[0]) == V
    none = LLM(tiny, progress=False, max_model_len=64, max_logprobs=0)
    with pytest.raises(ValueError, match="logprobs=1 is more than max_logprobs=0"):
        none.generate([[3, 4]], SamplingParams(max_tokens=1, logprobs=1))
    assert none.generate([[3, 4]], SamplingParams(max_tokens=1, logprobs=0))[0].outputs[0].logprobs[0]
