"""CheckpointReader / load_weights on small hand-built safetensors files."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from wideep.engine.model.loader import CheckpointError, CheckpointReader, expert_ignore, load_weights
from wideep.moe.fp8 import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block

META = {"format": "pt"}


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ckpt(tmp_path, tensors, shards=1):
    """Write `tensors` as model.safetensors, or round-robin into `shards` files plus an index."""
    if shards == 1:
        save_file(tensors, str(tmp_path / "model.safetensors"), metadata=META)
        return str(tmp_path)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(tmp_path / file), metadata=META)
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(tmp_path)


def _empty_like_ckpt(tensors):
    return {n: torch.empty_like(t, dtype=torch.float32) for n, t in tensors.items()}


@pytest.mark.parametrize("shards", [1, 3])
def test_single_and_sharded_load_everything(tmp_path, shards):
    tensors = {"model.embed_tokens.weight": _rand(10, 4), "model.norm.weight": _rand(4, seed=1),
               "model.layers.0.self_attn.o_proj.weight": _rand(4, 6, seed=2),
               "lm_head.weight": _rand(10, 4, seed=3).to(torch.bfloat16)}
    reader = CheckpointReader(_ckpt(tmp_path, tensors, shards))
    assert reader.names == set(tensors)
    assert reader.shape("model.layers.0.self_attn.o_proj.weight") == (4, 6)
    targets = _empty_like_ckpt(tensors)
    report = load_weights(reader, targets, progress=False)
    for n, t in tensors.items():
        torch.testing.assert_close(targets[n], t.float(), rtol=0, atol=0)
    assert (report.loaded, report.skipped_mtp, report.ignored) == (4, 0, 0)
    assert report.bytes_loaded == sum(t.numel() * 4 for t in tensors.values())


def test_fp8_dequantised_with_partial_edge_blocks(tmp_path):
    w = _rand(200, 136)  # 2 x 2 blocks of 128, both edges partial
    q, s = quantize_fp8_block(w)
    name = "model.layers.0.mlp.down_proj.weight"
    reader = CheckpointReader(_ckpt(tmp_path, {name: q, name + "_scale_inv": s}, shards=2))
    assert reader.shape(name) == (200, 136) and s.shape == (2, 2)
    want = dequantize_fp8_block(q, s)
    torch.testing.assert_close(reader.get(name, torch.float32), want, rtol=0, atol=0)
    assert reader.get(name, torch.bfloat16).dtype == torch.bfloat16
    assert reader.get(name, FP8_DTYPE).view(torch.uint8).equal(q.view(torch.uint8))  # raw for fp8 kernels
    dest = torch.zeros(200, 136)
    report = load_weights(reader, {name: dest}, progress=False)  # the scale is consumed, not unexpected
    torch.testing.assert_close(dest, want, rtol=0, atol=0)
    assert report.loaded == 1


def test_fp8_block_size_taken_from_config(tmp_path):
    w = _rand(64, 64)
    q, s = quantize_fp8_block(w, (32, 32))
    name = "model.layers.0.mlp.up_proj.weight"
    _ckpt(tmp_path, {name: q, name + "_scale_inv": s})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [32, 32]}}))
    reader = CheckpointReader(str(tmp_path))
    torch.testing.assert_close(reader.get(name, torch.float32), dequantize_fp8_block(q, s, (32, 32)))


def test_fp8_without_scale_is_an_error(tmp_path):
    q, _ = quantize_fp8_block(_rand(8, 8))
    reader = CheckpointReader(_ckpt(tmp_path, {"model.layers.0.mlp.up_proj.weight": q}))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*up_proj\.weight_scale_inv"):
        reader.get("model.layers.0.mlp.up_proj.weight", torch.float32)


def test_missing_tensor_names_it(tmp_path):
    reader = CheckpointReader(_ckpt(tmp_path, {"a.weight": _rand(2)}))
    targets = {"a.weight": torch.empty(2), "model.norm.weight": torch.empty(2), "lm_head.weight": torch.empty(2)}
    with pytest.raises(CheckpointError, match=r"2 tensors.*lm_head\.weight, model\.norm\.weight"):
        load_weights(reader, targets, progress=False)


def test_many_missing_are_truncated(tmp_path):
    reader = CheckpointReader(_ckpt(tmp_path, {"a": _rand(2)}))
    targets = {f"t{i:02d}": torch.empty(2) for i in range(25)} | {"a": torch.empty(2)}
    with pytest.raises(CheckpointError, match=r"25 tensors.*t09 \.\.\. and 15 more"):
        load_weights(reader, targets, progress=False)


def test_unexpected_tensor_names_it(tmp_path):
    reader = CheckpointReader(_ckpt(tmp_path, {"a": _rand(2), "model.layers.0.extra.weight": _rand(3)}))
    with pytest.raises(CheckpointError, match=r"not used by the model.*model\.layers\.0\.extra\.weight"):
        load_weights(reader, {"a": torch.empty(2)}, progress=False)


def test_wrong_shape_names_expected_and_found(tmp_path):
    reader = CheckpointReader(_ckpt(tmp_path, {"model.norm.weight": _rand(4)}))
    dest = torch.zeros(5)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: expected \(5,\), found \(4,\)"):
        load_weights(reader, {"model.norm.weight": dest}, progress=False)
    assert dest.eq(0).all()  # nothing was copied


def test_mtp_layers_skipped_and_never_read(tmp_path, monkeypatch, caplog):
    q, s = quantize_fp8_block(_rand(8, 4))
    tensors = {"model.layers.0.input_layernorm.weight": _rand(4), "model.layers.1.input_layernorm.weight": _rand(4),
               "model.layers.2.eh_proj.weight": _rand(4, 8), "model.layers.2.enorm.weight": _rand(4),
               "model.layers.2.self_attn.kv_b_proj.weight": q, "model.layers.2.self_attn.kv_b_proj.weight_scale_inv": s,
               "model.layers.10.shared_head.head.weight": _rand(6, 4)}
    reader = CheckpointReader(_ckpt(tmp_path, tensors))
    read = []
    real_get, real_into = reader.get, reader.read_into
    monkeypatch.setattr(reader, "get", lambda name, *a, **k: read.append(name) or real_get(name, *a, **k))
    monkeypatch.setattr(reader, "read_into", lambda name, *a: read.append(name) or real_into(name, *a))
    targets = {n: torch.empty(4) for n in tensors if n.startswith(("model.layers.0.", "model.layers.1."))}
    with caplog.at_level(logging.INFO, logger="wideep.loader"):
        report = load_weights(reader, targets, num_hidden_layers=2, progress=False)
    assert sorted(set(read)) == sorted(targets)
    assert report.skipped_mtp == 5 and report.loaded == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "wideep.loader"]
    assert len(lines) == 1 and "[2, 10]" in lines[0]
    with pytest.raises(CheckpointError, match="not used by the model"):  # without the layer count: unexpected
        load_weights(reader, targets, progress=False)


def test_expert_ignore_skips_other_ranks_experts(tmp_path, monkeypatch):
    tensors = {}
    for e in range(4):
        for p in ("gate_proj", "up_proj", "down_proj"):
            q, s = quantize_fp8_block(_rand(6, 6, seed=e))
            tensors[f"model.layers.1.mlp.experts.{e}.{p}.weight"] = q
            tensors[f"model.layers.1.mlp.experts.{e}.{p}.weight_scale_inv"] = s
    reader = CheckpointReader(_ckpt(tmp_path, tensors))
    read = []
    real_get, real_into = reader.get, reader.read_into
    monkeypatch.setattr(reader, "get", lambda name, *a, **k: read.append(name) or real_get(name, *a, **k))
    monkeypatch.setattr(reader, "read_into", lambda name, *a: read.append(name) or real_into(name, *a))
    mine = {2, 3}  # this rank owns experts 2 and 3 of layer 1
    targets = {f"model.layers.1.mlp.experts.{e}.{p}.weight": torch.empty(6, 6)
               for e in mine for p in ("gate_proj", "up_proj", "down_proj")}
    ignore = expert_ignore(lambda layer, e: e in mine)
    report = load_weights(reader, targets, ignore=ignore, progress=False)
    assert report.loaded == 6 and report.ignored == 12  # 2 experts x 3 weights x (weight + scale)
    assert all(".experts.2." in n or ".experts.3." in n for n in read)
    assert not ignore("model.layers.1.mlp.shared_experts.gate_proj.weight")
    assert ignore("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv")


def test_view_into_stacked_parameter(tmp_path):
    E, Im, H = 3, 4, 5
    tensors = {}
    for e in range(E):
        tensors[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = _rand(Im, H, seed=10 * e)
        tensors[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = _rand(Im, H, seed=10 * e + 1)
    reader = CheckpointReader(_ckpt(tmp_path, tensors))
    w13 = torch.nn.Parameter(torch.zeros(2, 2 * Im, H))  # local experts 0 -> global 2, 1 -> global 0
    local_to_global = [2, 0]
    targets = {}
    for local, e in enumerate(local_to_global):
        targets[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = w13[local, :Im]
        targets[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = w13[local, Im:]
    load_weights(reader, targets, ignore=expert_ignore(lambda i, e: e in local_to_global), progress=False)
    for local, e in enumerate(local_to_global):
        assert w13[local, :Im].equal(tensors[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert w13[local, Im:].equal(tensors[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])


def test_missing_dir_and_no_safetensors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointReader(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no safetensors.*model\.safetensors.*index\.json"):
        CheckpointReader(str(tmp_path))


def test_index_pointing_to_missing_shard(tmp_path):
    _ckpt(tmp_path, {"a": _rand(2), "b": _rand(2)}, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"'b'.*model-00002-of-00002\.safetensors.*does not exist"):
        CheckpointReader(str(tmp_path))


def test_every_stored_dtype_reads_back_exactly_without_mapping_the_file(tmp_path):
    """SafetensorsFile (pread into memory of its own, never a mapping: a loaded checkpoint adds to the resident set
    only what the model keeps) reads what safetensors wrote, bit for bit, in every dtype a checkpoint holds."""
    from wideep.engine.model.loader import SafetensorsFile
    g = torch.Generator().manual_seed(5)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, 7, generator=g).bfloat16(),
               "f16": torch.randn(2, 3, generator=g).half(), "f64": torch.randn(3, generator=g).double(),
               "fp8": torch.randn(6, 4, generator=g).to(torch.float8_e4m3fn),
               "e8m0": torch.rand(5, 2, generator=g).to(torch.float8_e8m0fnu),
               "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
               "u8": torch.randint(0, 255, (3, 3), dtype=torch.uint8, generator=g),
               "i32": torch.arange(7, dtype=torch.int32), "i64": torch.arange(5), "b": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata=META)
    f = SafetensorsFile(path)
    assert sorted(f.keys()) == sorted(tensors)
    for name, t in tensors.items():
        got = f.get_tensor(name)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else got,
                           t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else t), name
        assert f.get_slice(name).get_shape() == list(t.shape)
    maps = open("/proc/self/maps").read()
    assert path not in maps


def test_read_into_fills_the_destination_in_place_where_it_is_a_plain_copy(tmp_path):
    """load_weights reads a tensor straight into its destination (SafetensorsFile.read_into: no buffer, no copy)
    where the stored dtype and shape are the destination's and it is contiguous: every dtype a checkpoint holds, a
    contiguous row block of a stacked parameter, a scalar, an empty tensor. Elsewhere (another dtype, a strided
    destination, a block scale) nothing is read and get + copy_ run: the same values either way."""
    from wideep.engine.model.loader import SafetensorsFile
    g = torch.Generator().manual_seed(7)
    tensors = {"bf16": torch.randn(4, 7, generator=g).bfloat16(), "f32": torch.randn(3, 5, generator=g),
               "fp8": torch.randn(6, 4, generator=g).to(torch.float8_e4m3fn), "i64": torch.arange(5),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata=META)
    f = SafetensorsFile(path)
    for name, t in tensors.items():
        out = torch.full_like(t, 3) if t.dtype != torch.float8_e4m3fn else torch.empty_like(t)
        assert f.read_into(name, out), name
        assert torch.equal(out.view(torch.uint8) if t.element_size() == 1 else out,
                           t.view(torch.uint8) if t.element_size() == 1 else t), name
    stacked = torch.zeros(3, 4, 7, dtype=torch.bfloat16)
    assert f.read_into("bf16", stacked[1]) and torch.equal(stacked[1], tensors["bf16"]) and not stacked[0].any()
    assert not f.read_into("bf16", torch.zeros(4, 7))                      # another dtype
    assert not f.read_into("bf16", torch.zeros(7, 4, dtype=torch.bfloat16).t())   # strided
    assert not f.read_into("bf16", torch.zeros(28, dtype=torch.bfloat16))  # another shape
    # through load_weights: in place for the bf16 / fp8 destinations, converted for float32 ones, scales as before
    w = _rand(40, 64)
    q, sc = quantize_fp8_block(w, (16, 32))
    ckpt = {"a.weight": tensors["bf16"], "b.weight": q, "b.weight_scale_inv": sc, "c.weight": tensors["bf16"].clone()}
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [16, 32]}}))
    reader = CheckpointReader(_ckpt(d, ckpt))
    targets = {"a.weight": torch.zeros(4, 7, dtype=torch.bfloat16), "b.weight": torch.empty(40, 64, dtype=FP8_DTYPE),
               "b.weight_scale_inv": torch.zeros_like(sc), "c.weight": torch.zeros(4, 7)}
    load_weights(reader, targets, progress=False)
    assert torch.equal(targets["a.weight"], tensors["bf16"]) and torch.equal(targets["c.weight"], tensors["bf16"].float())
    assert torch.equal(targets["b.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(targets["b.weight_scale_inv"], sc)


def test_a_damaged_safetensors_file_is_named(tmp_path):
    from wideep.engine.model.loader import SafetensorsFile
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path), metadata=META)
    data = path.read_bytes()
    path.write_bytes(data[:-100])                  # cut short: the tensor lies past the end
    with pytest.raises(CheckpointError, match=r"tensor 'w' lies past the end of the file"):
        SafetensorsFile(str(path))
    path.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        SafetensorsFile(str(path))
    path.write_bytes((10).to_bytes(8, "little") + b"{not json}")
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        SafetensorsFile(str(path))
