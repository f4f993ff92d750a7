"""Tiny random checkpoints: parse with wideep's config, load in transformers, read with the loader."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from wideep.engine.model.model_config import ModelConfig
from wideep.engine.model.loader import CheckpointReader, load_weights
from wideep.launch.tiny.checkpoint import checkpoint_shapes, make_tiny_checkpoint, tiny_config
from wideep.moe.fp8 import FP8_DTYPE


def _all_tensors(d: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out |= load_file(os.path.join(d, f))
    return out


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_config_parses(tmp_path, arch):
    cfg = ModelConfig.from_dir(make_tiny_checkpoint(str(tmp_path), arch=arch))
    assert cfg.arch == arch and cfg.num_hidden_layers == 4 and cfg.moe_layers == [1, 2, 3]
    assert cfg.mla.rope.kind == "yarn" and cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0
    assert cfg.quant is None
    if arch == "v3":
        assert cfg.mla.q_lora_rank == 48 and cfg.moe.topk_method == "noaux_tc" and cfg.moe.scoring_func == "sigmoid"
        assert cfg.moe.n_shared_experts == 1 and cfg.moe.routed_scaling_factor == 2.5 and cfg.moe.norm_topk_prob
    else:
        assert cfg.mla.q_lora_rank is None and cfg.moe.topk_method == "group_limited_greedy"
        assert cfg.moe.n_shared_experts == 2 and cfg.moe.scoring_func == "softmax" and not cfg.moe.norm_topk_prob
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": 1}


def test_overrides(tmp_path):
    make_tiny_checkpoint(str(tmp_path), hidden_size=96, n_routed_experts=8, n_group=2, topk_group=1, rope_scaling=None)
    cfg = ModelConfig.from_dir(str(tmp_path))
    assert cfg.hidden_size == 96 and cfg.moe.n_routed_experts == 8 and cfg.mla.rope.kind == "default"
    assert CheckpointReader(str(tmp_path)).shape("model.layers.1.mlp.gate.weight") == (8, 96)
    with pytest.raises(ValueError, match="unknown config fields.*hiden_size"):
        tiny_config(hiden_size=3)


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_transformers_loads_and_runs(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    d = make_tiny_checkpoint(str(tmp_path), arch=arch)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert type(model).__name__ == {"v2": "DeepseekV2ForCausalLM", "v3": "DeepseekV3ForCausalLM"}[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    # transformers fuses experts on load; check our per-expert names landed where it expects them.
    saved = _all_tensors(d)
    experts, Im = model.model.layers[2].mlp.experts, 32
    assert experts.gate_up_proj[5, :Im].equal(saved["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert experts.gate_up_proj[5, Im:].equal(saved["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert experts.down_proj[5].equal(saved["model.layers.2.mlp.experts.5.down_proj.weight"])
    if arch == "v3":
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.equal(saved["model.layers.1.mlp.gate.e_score_correction_bias"]) and bias.abs().min() > 0
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7, 100, 200]])).logits
    assert logits.shape == (1, 6, 256) and logits.isfinite().all()


def test_fp8_dtypes_and_scales(tmp_path):
    plain = _all_tensors(make_tiny_checkpoint(str(tmp_path / "bf"), intermediate_size=200))
    d = make_tiny_checkpoint(str(tmp_path / "fp8"), fp8=True, intermediate_size=200)
    cfg = ModelConfig.from_dir(d)
    assert cfg.quant is not None and cfg.quant.weight_block_size == (128, 128)
    saved = _all_tensors(d)
    linears = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    quantised = [n for n in plain if n.endswith(tuple(f".{m}.weight" for m in linears))]
    assert len(quantised) == 5 * 4 + 3 + 3 * (3 * 16 + 3)  # attention x 4 layers, dense MLP, experts + shared
    assert set(saved) == set(plain) | {n + "_scale_inv" for n in quantised}
    for n in quantised:
        rows, cols = plain[n].shape
        assert saved[n].dtype == FP8_DTYPE and saved[n].shape == (rows, cols)
        assert saved[n + "_scale_inv"].dtype == torch.float32
        assert saved[n + "_scale_inv"].shape == (-(-rows // 128), -(-cols // 128))
    assert saved["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)  # 200 rows: partial block
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.1.mlp.gate.e_score_correction_bias", "model.norm.weight"):
        assert saved[n].dtype == torch.float32 and saved[n].equal(plain[n])
    # Same seed, same draws: the dequantised fp8 weights are the plain ones up to e4m3 rounding.
    reader = CheckpointReader(d)
    for n in ("model.layers.0.mlp.gate_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"):
        torch.testing.assert_close(reader.get(n, torch.float32), plain[n], rtol=0.07, atol=1e-3)


def test_sharded_index(tmp_path):
    d = make_tiny_checkpoint(str(tmp_path), shards=3, fp8=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not os.path.exists(tmp_path / "model.safetensors")
    single = _all_tensors(make_tiny_checkpoint(str(tmp_path / "one"), fp8=True))
    sharded = _all_tensors(d)
    assert sharded.keys() == single.keys()
    assert all(sharded[n].view(torch.uint8).equal(single[n].view(torch.uint8)) for n in single)


def test_deterministic(tmp_path):
    a = (tmp_path / "a" / "model.safetensors")
    make_tiny_checkpoint(str(tmp_path / "a"), seed=3)
    make_tiny_checkpoint(str(tmp_path / "b"), seed=3)
    make_tiny_checkpoint(str(tmp_path / "c"), seed=4)
    assert a.read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a.read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_mtp_layers_written_and_skipped_by_loader(tmp_path):
    d = make_tiny_checkpoint(str(tmp_path), fp8=True, num_nextn_predict_layers=1)
    reader = CheckpointReader(d)
    assert "model.layers.4.eh_proj.weight" in reader.names
    assert reader.get("model.layers.4.mlp.experts.0.up_proj.weight", torch.float32).shape == (32, 64)
    shapes = {n: s for n, s in checkpoint_shapes(tiny_config(num_nextn_predict_layers=1)).items()
              if not n.startswith("model.layers.4.")}
    targets = {n: torch.empty(s) for n, s in shapes.items()}
    report = load_weights(reader, targets, num_hidden_layers=4, progress=False)
    assert report.loaded == len(targets) and report.skipped_mtp > 0 and report.ignored == 0
    assert targets["model.layers.0.self_attn.kv_a_layernorm.weight"].sub(1).abs().max() < 0.5


def test_tokenizer_round_trips(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    make_tiny_checkpoint(str(tmp_path))
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Hello, wörld! 你好 🎉\n\tend"
    ids = tok.encode(text).ids
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == 0 and tok.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert tok.encode("<｜end▁of▁sentence｜>").ids == [1]


def test_v4_loads_in_transformers_and_generates_through_llm(tmp_path, capsys):
    """`wideep make-tiny --arch v4`: transformers loads every tensor, the degenerate initial values are randomised,
    and wideep's LLM generates transformers' greedy tokens (with its defaults: prefix caching on)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("transformers without DeepSeek-V4")
    from wideep.engine import LLM, SamplingParams
    from wideep.launch.cli.main import main
    main(["make-tiny", "--out", str(tmp_path), "--arch", "v4"])
    assert "wrote a tiny DeepSeek-V4 checkpoint" in capsys.readouterr().out
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert type(hf).__name__ == "DeepseekV4ForCausalLM" and hf.config.vocab_size == 256
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    saved = _all_tensors(str(tmp_path))
    tid2eid = saved["model.layers.0.ffn.gate.tid2eid"]
    assert tid2eid.shape == (256, 2) and (tid2eid[:, 0] != tid2eid[:, 1]).all() and tid2eid.unique().numel() == 8
    for name in ("model.layers.2.ffn.gate.bias", "model.layers.2.attn.attn_sink", "model.layers.0.hc_attn_base"):
        assert saved[name].abs().min() > 0, f"{name} kept transformers' zeros"
    ids = [0, 5, 6, 7, 100, 200, 31, 9, 77, 150, 12]
    with torch.no_grad():
        want = hf.float().generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = want[0, len(ids):]
    llm = LLM(str(tmp_path), dtype="float32", progress=False)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want.tolist()
    assert llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0].outputs[0].text
    llm.shutdown()


def test_v4_bad_arguments(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"fp8 \(True\) and shards \(1\).*arch 'v4'"):
        make_tiny_checkpoint(str(tmp_path), arch="v4", fp8=True)
    with pytest.raises(ValueError, match=r"shards \(2\)"):
        make_tiny_checkpoint(str(tmp_path), arch="v4", shards=2)
    with pytest.raises(ValueError, match=r"unknown DeepseekV4Config fields \['hiden_size'\]"):
        make_tiny_checkpoint(str(tmp_path), arch="v4", hiden_size=3)
    with pytest.raises(ValueError, match="arch 'v4' has no hand-written config"):
        tiny_config("v4")
    with pytest.raises(ValueError, match=r"arch 'v5' is not one of .*\(or 'v4'\)"):
        tiny_config("v5")
