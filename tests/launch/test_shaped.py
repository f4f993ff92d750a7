"""make-shaped: published configs, truncation, the tensor plan (dry run), a real V2-Lite one-layer write read back by
safetensors and wideep's CheckpointReader, determinism, and bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from wideep.engine.model.loader import CheckpointReader, v4_rename
from wideep.launch.cli.main import main
from wideep.launch.tiny.published import LIKES, layer_kinds, truncated_config
from wideep.launch.tiny.shaped import _chunks, make_shaped_checkpoint, plan_shaped

GB = 10 ** 9


def test_published_numbers():
    v3 = truncated_config("deepseek-v3", 61)
    assert (v3["hidden_size"], v3["num_attention_heads"], v3["q_lora_rank"], v3["kv_lora_rank"]) == (7168, 128, 1536, 512)
    assert (v3["qk_nope_head_dim"], v3["qk_rope_head_dim"], v3["v_head_dim"]) == (128, 64, 128)
    assert (v3["intermediate_size"], v3["moe_intermediate_size"], v3["n_routed_experts"], v3["n_shared_experts"]) == (
        18432, 2048, 256, 1)
    assert (v3["num_experts_per_tok"], v3["n_group"], v3["topk_group"], v3["first_k_dense_replace"]) == (8, 8, 4, 3)
    assert (v3["vocab_size"], v3["rope_scaling"]["factor"], v3["routed_scaling_factor"]) == (129280, 40, 2.5)
    assert v3["quantization_config"]["weight_block_size"] == [128, 128]
    lite = truncated_config("deepseek-v2-lite", 27)
    assert (lite["hidden_size"], lite["num_attention_heads"], lite["q_lora_rank"], lite["kv_lora_rank"]) == (
        2048, 16, None, 512)
    assert (lite["intermediate_size"], lite["moe_intermediate_size"], lite["n_routed_experts"],
            lite["n_shared_experts"], lite["num_experts_per_tok"]) == (10944, 1408, 64, 2, 6)
    assert (lite["vocab_size"], lite["first_k_dense_replace"], lite["rope_scaling"]["mscale"]) == (102400, 1, 0.707)
    v4 = truncated_config("deepseek-v4-flash", 43)
    assert (v4["hidden_size"], v4["num_attention_heads"], v4["head_dim"], v4["q_lora_rank"]) == (4096, 64, 512, 1024)
    assert (v4["o_groups"], v4["o_lora_rank"], v4["sliding_window"], v4["index_topk"]) == (8, 1024, 128, 512)
    assert (v4["moe_intermediate_size"], v4["n_routed_experts"], v4["num_experts_per_tok"], v4["num_hash_layers"]) == (
        2048, 256, 6, 3)
    assert v4["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4] and v4["quantization_config"]["scale_fmt"] == "ue8m0"


def test_truncation_keeps_layer_types():
    assert layer_kinds(truncated_config("deepseek-v3", 4)) == ["dense"] * 3 + ["moe"]
    assert layer_kinds(truncated_config("deepseek-v2-lite", 2)) == ["dense", "moe"]
    assert layer_kinds(truncated_config("deepseek-v4-flash", 5)) == [
        "sliding+hash_moe", "sliding+hash_moe", "csa+hash_moe", "hca+moe", "csa+moe"]
    for like in LIKES:
        c = truncated_config(like, 1)
        assert c["num_hidden_layers"] == 1 and c.get("num_nextn_predict_layers", 0) == 0


@pytest.mark.parametrize("like,layers", [("deepseek-v3", 0), ("deepseek-v3", 62), ("deepseek-v2-lite", 28),
                                         ("deepseek-v4-flash", -1)])
def test_bad_layers(like, layers):
    with pytest.raises(ValueError, match=rf"--layers {layers}: {like} has \d+ layers"):
        truncated_config(like, layers)


def test_bad_like_and_out(tmp_path, capsys):
    with pytest.raises(ValueError, match="--like 'deepseek-v9' is not a known model; known: deepseek-v3"):
        plan_shaped("deepseek-v9", 1)
    (tmp_path / "x").write_text("x")
    with pytest.raises(SystemExit):
        main(["make-shaped", "--like", "deepseek-v2-lite", "--layers", "1", "--out", str(tmp_path)])
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_v3_plan_names_dtypes_shapes():
    plan = plan_shaped("deepseek-v3", 4)
    specs = {s.name: s for shard in plan.shards for s in shard}
    p = "model.layers.3.mlp."
    assert specs[p + "experts.255.gate_proj.weight"].shape == (2048, 7168)
    assert specs[p + "experts.255.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert specs[p + "experts.255.down_proj.weight_scale_inv"].shape == (56, 16)
    assert specs[p + "experts.255.down_proj.weight_scale_inv"].dtype == torch.float32
    assert specs[p + "gate.e_score_correction_bias"].dtype == torch.float32
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)
    assert specs["model.layers.0.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
    assert specs["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "model.layers.2.mlp.experts.0.up_proj.weight" not in specs and "model.layers.4.input_layernorm.weight" not in specs
    assert all(sum(s.nbytes for s in shard) <= 5 * GB for shard in plan.shards) and len(plan.shards) == 4
    assert plan.total_bytes == sum(s.nbytes for s in specs.values())


def test_v4_plan_names_dtypes_shapes():
    plan = plan_shaped("deepseek-v4-flash", 4, shard_bytes=2 * GB)
    specs = {s.name: s for shard in plan.shards for s in shard}
    e = specs["layers.3.ffn.experts.0.w1.weight"]
    assert (e.shape, e.dtype) == ((2048, 2048), torch.int8)
    assert (specs["layers.3.ffn.experts.0.w2.scale"].shape, specs["layers.3.ffn.experts.0.w2.scale"].dtype) == (
        (4096, 64), torch.float8_e8m0fnu)
    assert specs["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert specs["layers.0.attn.wq_b.scale"].shape == (256, 8)
    assert "layers.0.attn.compressor.ape" not in specs and "layers.2.attn.indexer.wq_b.weight" in specs
    assert specs["layers.3.attn.compressor.ape"].shape == (128, 512) and "layers.3.attn.indexer.wq_b.weight" not in specs
    assert "layers.2.ffn.gate.tid2eid" in specs and "layers.3.ffn.gate.bias" in specs
    assert len(plan.shards) > 1 and all(sum(s.nbytes for s in sh) <= 2 * GB for sh in plan.shards)


def test_v2_lite_write_and_read(tmp_path):
    out = str(tmp_path / "lite")
    plan = make_shaped_checkpoint(out, "deepseek-v2-lite", 1, seed=3, shard_bytes=300_000_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    n = len(plan.shards)
    assert n > 1 and sorted(set(index["weight_map"].values())) == [f"model-{k:05d}-of-{n:05d}.safetensors"
                                                                   for k in range(1, n + 1)]
    assert index["metadata"]["total_size"] == plan.total_bytes
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == 102400
    reader = CheckpointReader(out)
    assert reader.names == frozenset(index["weight_map"])
    for shard in plan.shards:
        with safe_open(os.path.join(out, index["weight_map"][shard[0].name]), framework="pt") as f:
            for s in shard:
                t = f.get_tensor(s.name)
                assert (tuple(t.shape), t.dtype) == (s.shape, s.dtype)
    emb = reader.get("model.embed_tokens.weight", torch.float32)
    assert emb.shape == (102400, 2048) and torch.isfinite(emb).all() and 1e-3 < emb.abs().mean() < 0.05
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == 100001


def test_same_seed_same_bytes():
    plan = plan_shaped("deepseek-v3", 4)
    specs = {s.name: s for shard in plan.shards for s in shard}
    for name in ("model.layers.3.mlp.experts.7.up_proj.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.3.mlp.experts.7.up_proj.weight_scale_inv"):
        a, b = (torch.cat(list(_chunks(specs[name], 0))) for _ in range(2))
        assert torch.equal(a, b) and not torch.equal(a, torch.cat(list(_chunks(specs[name], 1))))
    fp8 = torch.cat(list(_chunks(specs["model.layers.3.mlp.experts.7.up_proj.weight"], 0)))
    assert torch.isfinite(fp8.view(torch.float8_e4m3fn).float()).all()


def test_v4_checkpoint_names_as_the_loader_reads_them(tmp_path):
    # the FP4 / FP8 / e8m0 formats of a V4 plan, written for one layer at a tiny shard size, read back by the reader
    plan = plan_shaped("deepseek-v4-flash", 1)
    names = {s.name for shard in plan.shards for s in shard}
    renamed = {v4_rename(n) for n in names}
    assert "layers.0.attn.wq_a.weight_scale_inv" in renamed and "layers.0.attn.norm.weight" in renamed
    assert "embed.weight" in renamed and "head.weight" in renamed
