"""config.json of DeepSeek-V3.2, GLM-4.x-MoE-lite and Kimi-K2.5 (as published and as transformers writes
them), every bad field named (DeepSeek-V4's: tests/engine/test_v4_config.py); the loader reads a multimodal
checkpoint's text model under either prefix and never its vision tower; make-tiny for each arch."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from wideep.engine.model.model_config import ConfigError, ModelConfig
from wideep.engine.model.loader import CheckpointError, CheckpointReader, text_model_rename
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint, tiny_config


def test_v32_published_config():
    cfg = ModelConfig.from_dict(tiny_config("v32"))
    assert cfg.arch == "v32" and cfg.dsa is not None
    assert (cfg.dsa.index_n_heads, cfg.dsa.index_head_dim, cfg.dsa.index_topk) == (16, 32, 16)
    assert (cfg.moe.topk_method, cfg.moe.scoring_func) == ("noaux_tc", "sigmoid") and cfg.mla.rope.interleave
    c = tiny_config("v32")
    for k in ("index_n_heads", "index_head_dim", "index_topk", "first_k_dense_replace", "topk_method", "scoring_func"):
        del c[k]  # transformers' defaults are DeepSeek-V3.2's; V3-style routing
    cfg = ModelConfig.from_dict(c)
    assert (cfg.dsa.index_n_heads, cfg.dsa.index_head_dim, cfg.dsa.index_topk) == (64, 128, 2048)
    assert cfg.moe_layers == [3] and cfg.moe.scoring_func == "sigmoid"


def test_mlp_layer_types_as_transformers_writes_them():
    c = tiny_config("v32", num_hidden_layers=4)
    c.update(mlp_layer_types=["dense", "sparse", "sparse", "sparse"])   # with first_k_dense_replace 1: agree
    assert ModelConfig.from_dict(c).moe_layers == [1, 2, 3]
    c = tiny_config("glm4_moe_lite")
    del c["first_k_dense_replace"]
    c["mlp_layer_types"] = ["dense", "dense", "sparse", "dense"]
    assert ModelConfig.from_dict(c).moe_layers == [2]
    del c["mlp_layer_types"]
    assert ModelConfig.from_dict(c).moe_layers == [1, 2, 3]   # GLM-lite: one dense layer by default


def test_glm4_moe_lite_config():
    cfg = ModelConfig.from_dict(tiny_config("glm4_moe_lite"))
    assert cfg.arch == "glm4_moe_lite" and cfg.dsa is None and cfg.moe.n_group == 1
    assert (cfg.moe.topk_method, cfg.moe.scoring_func, cfg.moe.routed_scaling_factor) == ("noaux_tc", "sigmoid", 1.8)
    assert cfg.mla.rope.theta == 1e6 and cfg.mla.rope.kind == "default" and cfg.mla.v_head_dim == 24
    # the decoder norms take rms_norm_eps; the latent norms stay at 1e-6 (as transformers builds them)
    assert cfg.rms_norm_eps == 1e-5 and cfg.mla.rms_norm_eps == 1e-6


def test_kimi_k25_text_model():
    c = tiny_config("kimi_k25")
    cfg = ModelConfig.from_dict(c)
    assert cfg.arch == "v3" and cfg.wrapper == "kimi_k25" and cfg.hidden_size == 64 and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (1,) and cfg.moe.scoring_func == "sigmoid"
    del c["tie_word_embeddings"]            # transformers' Kimi_K25Config ties by default
    assert ModelConfig.from_dict(c).tie_word_embeddings
    c["architectures"] = ["Kimi_K25ForConditionalGeneration"]       # transformers' spelling
    assert ModelConfig.from_dict(c).wrapper == "kimi_k25"


@pytest.mark.parametrize("arch,edit,match", [
    ("v32", {"q_lora_rank": None}, "indexer reads the q-LoRA latent: config field 'q_lora_rank' must be set"),
    ("v32", {"index_head_dim": 4}, r"index_head_dim \(4\) must be at least that"),
    ("v32", {"index_topk": 0}, "'index_topk' must be an int >= 1, got 0"),
    ("v32", {"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]},
     r"'mlp_layer_types' .* and 'first_k_dense_replace' \(1, moe_layer_freq 1\) disagree"),
    ("v32", {"mlp_layer_types": ["dense", "moe"]}, "must list 'dense' or 'sparse' for each of the 4 layers"),
    ("glm4_moe_lite", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor' = 0.5 is not supported"),
    ("glm4_moe_lite", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "'partial_rotary_factor' = 0.5"),
])
def test_bad_fields_are_named(arch, edit, match):
    c = tiny_config(arch)
    c.update(edit)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(c)


@pytest.mark.parametrize("edit,match", [
    ({"text_config": None}, "needs a 'text_config' object"),
    ({"text_config": {"model_type": "glm4_moe_lite"}}, "text_config must be a DeepSeek-V3 model"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}},
     "'quantization_config.quant_method' = 'compressed-tensors' is not supported"),
])
def test_bad_kimi_k25_configs(edit, match):
    c = tiny_config("kimi_k25")
    c.update(edit)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(c)


def test_text_model_rename():
    assert text_model_rename("language_model.model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert text_model_rename("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert text_model_rename("language_model.lm_head.weight") == "lm_head.weight"
    assert text_model_rename("lm_head.weight") == "lm_head.weight"
    assert text_model_rename("vision_tower.encoder.blocks.0.wqkv.weight") is None
    assert text_model_rename("mm_projector.proj.0.bias") is None and text_model_rename("model.mm_projector.x") is None


def test_kimi_k25_checkpoint_is_read_as_its_text_model(tmp_path):
    from wideep.engine.model.families import load_model
    d = make_tiny_checkpoint(str(tmp_path / "k25"), arch="kimi_k25", seed=1)
    model = load_model(d, progress=False)
    rep = model.load_report
    assert rep.other_modalities == 23 and rep.loaded == len(model.checkpoint_targets())
    stored = load_file(str(tmp_path / "k25" / "model.safetensors"))
    assert torch.equal(model.model.layers[2].self_attn.kv_b_proj.weight,
                       stored["language_model.model.layers.2.self_attn.kv_b_proj.weight"])
    assert torch.equal(model.lm_head.weight, stored["language_model.lm_head.weight"])
    # the same tensors under transformers' in-memory prefix load the same
    save_file({("model.language_model." + n[len("language_model.model."):] if n.startswith("language_model.model.")
                else n): t for n, t in stored.items()}, str(tmp_path / "k25" / "model.safetensors"),
              metadata={"format": "pt"})
    again = load_model(d, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_two_names_for_one_tensor_is_an_error(tmp_path):
    d = make_tiny_checkpoint(str(tmp_path), arch="kimi_k25", seed=1)
    stored = load_file(f"{d}/model.safetensors")
    stored["model.language_model.norm.weight"] = stored["language_model.model.norm.weight"].clone()
    save_file(stored, f"{d}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="are both the model's 'model.norm.weight'"):
        CheckpointReader(d, rename=text_model_rename)


def test_v32_fp8_checkpoint_dequantises_the_indexer(tmp_path):
    from wideep.engine.model.families import load_model
    from wideep.moe.fp8 import FP8_DTYPE, dequantize_fp8_block
    d = make_tiny_checkpoint(str(tmp_path), arch="v32", fp8=True, seed=2)
    stored = load_file(f"{d}/model.safetensors")
    name = "model.layers.1.self_attn.indexer.wq_b.weight"
    assert stored[name].dtype == FP8_DTYPE and name + "_scale_inv" in stored
    assert stored["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    model = load_model(d, progress=False)
    want = dequantize_fp8_block(stored[name], stored[name + "_scale_inv"], (128, 128), torch.float32)
    assert torch.equal(model.model.layers[1].self_attn.indexer.wq_b.weight, want)
    assert model.model.layers[1].self_attn.indexer.weights_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("arch", ["v32", "glm4_moe_lite", "kimi_k25"])
def test_make_tiny_cli(arch, tmp_path, capsys):
    from wideep.launch.cli.main import main
    main(["make-tiny", "--out", str(tmp_path), "--arch", arch])
    assert "wrote a tiny" in capsys.readouterr().out
    reader = CheckpointReader(str(tmp_path), rename=text_model_rename if arch == "kimi_k25" else None)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in reader.names
    assert ("model.layers.0.self_attn.indexer.wk.weight" in reader.names) == (arch == "v32")
