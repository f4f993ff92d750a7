"""wideep vs transformers (the external oracle) on tiny random checkpoints, float32."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from wideep.engine import LLM, SamplingParams
from wideep.moe.fp8 import dequantize_fp8_block, quantize_fp8_block
from tests.oracle import hf_greedy, hf_prompt_logprobs, make_hf_model

PROMPTS = [[3, 17, 42, 99, 5, 150, 23, 8, 64, 11, 190, 7], [5, 6], [120, 33, 71, 2, 88, 14, 160]]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.707}

CASES = {
    # V3: sigmoid + noaux_tc, random non-zero correction bias, groups, q_lora, 2 dense layers first
    "v3_noaux_tc": dict(arch="v3", bias_std=0.2),
    # V2: no q_lora, softmax, group_limited_greedy
    "v2_group_limited": dict(arch="v2"),
    # V2-Lite style: greedy, no groups
    "v2_lite_greedy": dict(arch="v2", topk_method="greedy", n_group=None, topk_group=None, num_experts_per_tok=6),
    # YaRN (factor 8, mscale != 1) on V3
    "v3_yarn": dict(arch="v3", bias_std=0.1, rope_parameters=YARN),
}


def _compare(hf, model_dir: str, tol: float = 1e-4) -> None:
    llm = LLM(model_dir, dtype="float32", progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=0, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == ids
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        ours = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        ref = hf_prompt_logprobs(hf, ids)
        assert (ours - ref).abs().max().item() < tol, (ours, ref)
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 16)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_and_greedy_match_transformers(case, tmp_path):
    kw = dict(CASES[case])
    hf = make_hf_model(kw.pop("arch"), str(tmp_path), **kw)
    _compare(hf, str(tmp_path))


def test_fp8_checkpoint_matches_transformers_on_dequantised_weights(tmp_path):
    """Quantise a V3 model's linear weights into 128x128 blocks (dims not multiples of 128 included),
    write the checkpoint with quantization_config, compare with transformers on the dequantised weights."""
    from safetensors.torch import load_file, save_file
    hf = make_hf_model("v3", str(tmp_path), bias_std=0.1, hidden_size=192, intermediate_size=320,
                       moe_intermediate_size=80, kv_lora_rank=160, q_lora_rank=136, num_attention_heads=4)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    out, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and "lm_head" not in name:
            q, s = quantize_fp8_block(t, (128, 128))
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = dequantize_fp8_block(q, s, (128, 128))
        else:
            out[name] = t
    assert any(t.shape[0] % 128 and t.shape[0] > 128 for n, t in tensors.items() if n in deq)
    save_file(out, path, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    json.dump(cfg, open(os.path.join(tmp_path, "config.json"), "w"))
    with torch.no_grad():  # the oracle runs on exactly the weights the FP8 checkpoint encodes
        sd = hf.state_dict()
        for name, w in deq.items():
            if name in sd:
                sd[name].copy_(w)
            else:  # transformers stacks experts: model.layers.i.mlp.experts.{e}.{proj}.weight
                pre, e, proj, _ = name.rsplit(".", 3)
                e, I = int(e), hf.config.moe_intermediate_size
                if proj == "down_proj":
                    sd[pre + ".down_proj"][e].copy_(w)
                else:
                    dst = sd[pre + ".gate_up_proj"][e]
                    (dst[:I] if proj == "gate_proj" else dst[I:]).copy_(w)
    _compare(hf, str(tmp_path))


def test_batch_equals_one_at_a_time(tmp_path):
    make_hf_model("v3", str(tmp_path), bias_std=0.2)
    llm = LLM(str(tmp_path), progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=2, ignore_eos=True)
    batched = llm.generate(PROMPTS, sp)
    for ids, b in zip(PROMPTS, batched):
        (single,) = llm.generate([ids], sp)
        assert single.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(single.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert max(abs(x[k] - y[k]) for k in x) < 1e-5
