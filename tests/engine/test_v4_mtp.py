"""DeepSeek-V4's MTP blocks (engine/model/v4_model.py V4MTPBlock): a checkpoint with `mtp.0.*` tensors in DeepSeek's naming
(transformers' save_pretrained writes none, so the test adds them: one sliding-window block whose attention, MoE
and hyper-connection tensors are named and shaped like a decoder layer's, plus e_proj / h_proj / enorm / hnorm /
norm / hc_head_*) loads; every MTP tensor lands in a parameter of model.mtp, value for value, and the parameter
count matches the tensors'; the logits equal the same checkpoint's without them; bad MTP checkpoints are refused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from wideep.attention_v4.streams import V4Meta
from wideep.engine.model.families import load_model
from wideep.engine.model.loader import CheckpointError, v4_ignore, v4_mtp_blocks, v4_rename
from wideep.engine.model.model_config import ConfigError, ModelConfig
from tests.oracle_v4 import make_v4_model

PROMPT = [3, 17, 101, 42, 5, 199, 64, 8, 9, 150, 33, 2, 77]


def _mtp_tensors(ckpt: dict[str, torch.Tensor], k: int, seed: int) -> dict[str, torch.Tensor]:
    """Block k's tensors, DeepSeek's names: layer 0's (sliding attention) with a scored router (gate.bias in place of
    the hash table) and the MTP extras; fresh random values."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in ckpt.items():
        if name.startswith("model.layers.0.") and not name.endswith("gate.tid2eid"):
            out[f"mtp.{k}." + name[len("model.layers.0."):]] = 0.1 * torch.randn(t.shape, generator=g)
    E, H = ckpt["model.layers.2.ffn.gate.bias"].shape[0], ckpt["model.norm.weight"].shape[0]
    n = ckpt["model.hc_head.hc_base"].shape[0]
    extras = {"ffn.gate.bias": (E,), "e_proj.weight": (H, H), "h_proj.weight": (H, H), "enorm.weight": (H,),
              "hnorm.weight": (H,), "norm.weight": (H,), "hc_head_fn": (n, n * H), "hc_head_base": (n,),
              "hc_head_scale": (1,)}
    out |= {f"mtp.{k}.{name}": 0.1 * torch.randn(shape, generator=g) for name, shape in extras.items()}
    return out


def _with(src: str, dst: str, extra: dict[str, torch.Tensor], drop: tuple[str, ...] = (), **config) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    tensors = {n: t for n, t in load_file(os.path.join(src, "model.safetensors")).items()} | extra
    save_file({n: t for n, t in tensors.items() if n not in drop}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f) | config
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("v4"))
    make_v4_model(base)
    ckpt = load_file(os.path.join(base, "model.safetensors"))
    assert not any(n.startswith("mtp.") for n in ckpt), "transformers now saves MTP tensors: test them as saved"
    mtp = _mtp_tensors(ckpt, 0, seed=3)
    return base, _with(base, str(tmp_path_factory.mktemp("v4_mtp")), mtp), ckpt, mtp


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model.logits(model(torch.tensor(PROMPT), V4Meta.build([len(PROMPT)], [model.new_streams()])))


def test_mtp_tensors_land_in_the_mtp_block(ckpts):
    base, with_mtp, _, mtp = ckpts
    model = load_model(with_mtp, progress=False)
    assert len(model.mtp) == 1 and model.mtp[0].kind == "sliding" and model.mtp[0].index == 5
    owned = {p.data_ptr(): p for p in model.mtp.parameters()}
    targets = model.checkpoint_targets()
    for name, t in mtp.items():
        dest = targets[v4_rename(name)]
        assert torch.equal(dest, t.to(dest.dtype)), name
        assert any(p.data_ptr() <= dest.data_ptr() < p.data_ptr() + p.numel() * p.element_size()
                   for p in owned.values()), f"{name} is not in an MTP parameter"
    # nothing dropped: the block holds exactly the tensors' elements (every expert is local in one process)
    assert model.mtp_num_params() == sum(t.numel() for t in mtp.values())
    assert model.param_bytes()["mtp"] == 4 * model.mtp_num_params()
    assert model.load_report.skipped_mtp == 0 and model.load_report.ignored == 0
    plain = load_model(base, progress=False)
    assert len(plain.mtp) == 0 and plain.param_bytes()["mtp"] == 0
    assert plain.param_bytes()["total"] + plain.param_bytes()["mtp"] < model.param_bytes()["total"]
    assert torch.equal(_logits(model), _logits(plain)), "the MTP block changed the forward"


def test_mtp_experts_with_redundant_slots(ckpts):
    """Redundant slots replicate experts 0, 1, ...: the MTP block's hold copies of the logical experts."""
    _, with_mtp, _, mtp = ckpts
    model = load_model(with_mtp, progress=False, num_redundant_experts=2)
    ffn = model.mtp[0].ffn
    assert ffn.local_phy2log == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    I = ffn.experts.intermediate
    for slot, e in enumerate(ffn.local_phy2log):
        assert torch.equal(ffn.experts.w13.data[slot, :I], mtp[f"mtp.0.ffn.experts.{e}.w1.weight"])
        assert torch.equal(ffn.experts.w2.data[slot], mtp[f"mtp.0.ffn.experts.{e}.w2.weight"])


def test_incomplete_or_extra_mtp_blocks_are_refused(ckpts, tmp_path):
    base, _, ckpt, mtp = ckpts
    with pytest.raises(CheckpointError, match=r"not in the checkpoint.*mtp\.0\.e_proj\.weight"):
        load_model(_with(base, str(tmp_path / "a"), mtp, drop=("mtp.0.e_proj.weight",)), progress=False)
    with pytest.raises(CheckpointError, match=r"MTP blocks \[0\].*num_nextn_predict_layers 0"):
        load_model(_with(base, str(tmp_path / "b"), mtp, num_nextn_predict_layers=0), progress=False)
    with pytest.raises(CheckpointError, match=r"MTP blocks \[1\]"):
        load_model(_with(base, str(tmp_path / "c"), _mtp_tensors(ckpt, 1, seed=4), num_nextn_predict_layers=2),
                   progress=False)
    with pytest.raises(CheckpointError, match=r"not used by the model.*mtp\.0\.stray"):
        load_model(_with(base, str(tmp_path / "d"), mtp | {"mtp.0.stray.weight": torch.zeros(2)}), progress=False)


def test_mtp_blocks_helper_and_other_ranks_mtp_experts():
    assert v4_mtp_blocks(["layers.0.attn.wkv.weight"], 1) == 0
    assert v4_mtp_blocks(["mtp.0.e_proj.weight", "mtp.1.norm.weight"], 2) == 2
    ignore = v4_ignore(lambda layer, e: (layer, e) in {(5, 1), (0, 2)}, num_hidden_layers=5)
    assert not ignore("mtp.0.ffn.experts.1.w1.weight") and ignore("mtp.0.ffn.experts.2.w1.weight")
    assert not ignore("layers.0.ffn.experts.2.w2.weight") and ignore("layers.0.ffn.experts.1.w2.weight")
    assert not ignore("mtp.0.e_proj.weight")


def test_mtp_kinds_from_compress_ratios():
    raw = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=200, hidden_size=64,
               moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=48,
               n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16, index_n_heads=8,
               index_head_dim=16, index_topk=4, qk_rope_head_dim=8, num_nextn_predict_layers=2,
               compress_ratios=[0, 4, 128, 4, 0])
    v4 = ModelConfig.from_dict(raw).v4
    assert v4.layer_kinds == ("sliding", "csa", "hca") and v4.mtp_layer_kinds == ("csa", "sliding")
    # a block compress_ratios does not list is sliding-window, as in transformers' spelling (which lists none)
    assert ModelConfig.from_dict(dict(raw, compress_ratios=[0, 4, 128, 128])).v4.mtp_layer_kinds == ("hca", "sliding")
    assert ModelConfig.from_dict(dict(raw, num_nextn_predict_layers=0)).v4.mtp_layer_kinds == ()
    with pytest.raises(ConfigError, match=r"MTP entries \[4, 7\].*got \[7\]"):
        ModelConfig.from_dict(dict(raw, compress_ratios=[0, 4, 128, 4, 7]))


def test_deepseeks_own_kv_norm_name_loads(ckpts, tmp_path):
    """DeepSeek's V4 checkpoints name the attention's KV norm `attn.kv_norm` (layers and MTP blocks alike);
    transformers' save writes `attn.norm`. Both spellings load to the same model."""
    base, with_mtp, ckpt, mtp = ckpts
    tensors = ckpt | mtp
    renamed = {n.replace(".attn.norm.", ".attn.kv_norm."): t for n, t in tensors.items()}
    assert sum(".attn.kv_norm." in n for n in renamed) >= 6   # every layer and the MTP block
    real = _with(base, str(tmp_path / "ds"), renamed, drop=tuple(n for n in tensors if ".attn.norm." in n))
    a, b = load_model(with_mtp, progress=False), load_model(real, progress=False)
    assert b.load_report.ignored == 0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    assert torch.equal(_logits(a), _logits(b))
