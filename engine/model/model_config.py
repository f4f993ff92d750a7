"""Model config parsed from a HF `config.json`: DeepSeek-V2/V3 (Kimi-K2, Moonlight use V3), DeepSeek-V3.2
(V3 + DeepSeek Sparse Attention), GLM-4.x-MoE-lite (MLA + V3-style routing), Kimi-K2.5 (a V3 text
model under a multimodal config's `text_config`; wideep serves the text part) and DeepSeek-V4 (not MLA:
v4_config.py parses it into `v4`, with `mla` None)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from wideep.attention_mla.config import DSAConfig, MLAConfig, RopeConfig
from wideep.moe.config import MoEConfig

from .config_fields import ConfigError, config_int as _int
from .v4_config import V4Config, parse_v4

ARCHITECTURES = {"DeepseekV2ForCausalLM": "v2", "DeepseekV3ForCausalLM": "v3", "DeepseekV32ForCausalLM": "v32",
                 "Glm4MoeLiteForCausalLM": "glm4_moe_lite", "KimiK25ForConditionalGeneration": "kimi_k25",
                 "Kimi_K25ForConditionalGeneration": "kimi_k25",   # the second spelling is transformers'
                 "DeepseekV4ForCausalLM": "v4"}
MODEL_TYPES = {"deepseek_v2": "v2", "deepseek_v3": "v3", "kimi_k2": "v3", "deepseek_v32": "v32",
               "glm4_moe_lite": "glm4_moe_lite", "kimi_k25": "kimi_k25", "deepseek_v4": "v4"}
V3_ROUTING = ("v3", "v32", "glm4_moe_lite")         # sigmoid + noaux_tc when the config does not say
FIRST_DENSE_DEFAULT = {"v32": 3, "glm4_moe_lite": 1}  # transformers' defaults (mlp_layer_types)
# Configs that name these get an error that says why, not the generic "not supported" (none at present).
OUT_OF_SCOPE: dict[str, str] = {}
OUT_OF_SCOPE_ARCHS: dict[str, str] = {}


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8"
    weight_block_size: tuple[int, int]


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the text model: "v2" | "v3" | "v32" | "glm4_moe_lite" | "v4"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    mla: MLAConfig | None  # None for DeepSeek-V4 (its attention is `v4.attention`)
    moe: MoEConfig | None  # None: a dense model (n_routed_experts null)
    quant: QuantConfig | None
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dsa: DSAConfig | None = None        # DeepSeek Sparse Attention (V3.2): every layer's MLA gets an indexer
    mlp_layer_types: tuple[str, ...] | None = None   # "dense" | "sparse" per layer when config.json lists them
    wrapper: str | None = None          # "kimi_k25": the checkpoint is a multimodal model's, text under a prefix
    v4: "V4Config | None" = None        # DeepSeek-V4's attention kinds, hash layers, hyper-connections (v4_config.py)

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe is None:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer] == "sparse"
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir!r} has no config.json")
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        arch = _arch(raw)
        if arch == "kimi_k25":
            return _parse_kimi_k25(raw)
        if arch == "v4":
            return cls(**parse_v4(raw))
        return _parse(raw, arch)


def _arch(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    mt = raw.get("model_type")
    for key in [OUT_OF_SCOPE_ARCHS.get(a) for a in archs] + [mt]:
        if key in OUT_OF_SCOPE:
            raise ConfigError(OUT_OF_SCOPE[key])
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if archs:
        raise ConfigError(f"architectures {archs} is not supported; wideep serves {sorted(ARCHITECTURES)}")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ConfigError(f"config has no supported 'architectures' (got {archs}) or 'model_type' (got {mt!r}); "
                      f"wideep serves {sorted(ARCHITECTURES)}")


def _rope(raw: dict[str, Any], arch: str, rope_dim: int, max_pos: int) -> RopeConfig:
    # Published DeepSeek checkpoints write `rope_scaling` + top-level `rope_theta`; transformers >= 5
    # writes `rope_parameters` with rope_theta and rope_type inside.
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = dict(raw.get(field) or {})
    if not isinstance(params, dict):
        raise ConfigError(f"config field '{field}' must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    interleave = bool(raw.get("rope_interleave", True))
    if kind == "default":
        return RopeConfig(dim=rope_dim, theta=theta, interleave=interleave)
    if kind != "yarn":
        raise ConfigError(f"config field '{field}.rope_type' = {kind!r} is not supported (supported: default, yarn)")
    if "original_max_position_embeddings" not in params:
        raise ConfigError(f"config field '{field}.original_max_position_embeddings' is missing for yarn")
    factor = params.get("factor")
    orig = int(params["original_max_position_embeddings"])
    if factor is None:
        factor = max_pos / orig
    return RopeConfig(
        dim=rope_dim, theta=theta, kind="yarn", factor=float(factor), original_max_position=orig,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 1.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        interleave=interleave)


def _quant(raw: dict[str, Any]) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"config field 'quantization_config.quant_method' = {method!r} is not supported "
                          f"(supported: fp8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"config field 'quantization_config.fmt' = {fmt!r} is not supported (supported: e4m3)")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config field 'quantization_config.weight_block_size' must be two positive ints, "
                          f"got {block!r}")
    return QuantConfig(method="fp8", weight_block_size=(block[0], block[1]))


def _mlp_layer_types(raw: dict[str, Any], arch: str, layers: int) -> tuple[int, tuple[str, ...] | None]:
    """-> (first_k_dense_replace, mlp_layer_types or None). transformers >= 5 writes `mlp_layer_types` for
    V3.2 and GLM-lite (and builds those layers from it alone); published configs write first_k_dense_replace."""
    first_dense = _int(raw, "first_k_dense_replace", FIRST_DENSE_DEFAULT.get(arch, 0), lo=0) or 0
    if first_dense > layers:
        raise ConfigError(f"config field 'first_k_dense_replace' ({first_dense}) > num_hidden_layers ({layers})")
    types = raw.get("mlp_layer_types")
    if types is None:
        return first_dense, None
    if not isinstance(types, list) or len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise ConfigError(f"config field 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                          f"{layers} layers, got {types!r}")
    freq = _int(raw, "moe_layer_freq", 1) or 1
    implied = ["sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(layers)]
    if "first_k_dense_replace" in raw and list(types) != implied:
        raise ConfigError(f"config fields 'mlp_layer_types' {types} and 'first_k_dense_replace' ({first_dense}, "
                          f"moe_layer_freq {freq}) disagree on which layers are MoE")
    return first_dense, tuple(types)


def _dsa(raw: dict[str, Any], rope_dim: int, q_lora_rank: int | None) -> DSAConfig:
    if q_lora_rank is None:
        raise ConfigError("DeepSeek-V3.2's indexer reads the q-LoRA latent: config field 'q_lora_rank' must be set")
    try:  # transformers' defaults are DeepSeek-V3.2's
        return DSAConfig(index_n_heads=_int(raw, "index_n_heads", 64), index_head_dim=_int(raw, "index_head_dim", 128),
                         index_topk=_int(raw, "index_topk", 2048), rope_dim=rope_dim, q_lora_rank=q_lora_rank)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None


def _parse_kimi_k25(raw: dict[str, Any]) -> ModelConfig:
    """Kimi-K2.5: a DeepSeek-V3 text model in `text_config`; the vision tower and projector are not served.
    Word embeddings are tied as the top-level config says (transformers' Kimi_K25Config: default true),
    and a top-level quantization_config applies to the text model."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"a Kimi-K2.5 config needs a 'text_config' object (the language model), got {text!r}")
    text = dict(text)
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
    if raw.get("quantization_config"):
        text["quantization_config"] = raw["quantization_config"]
    arch = _arch({"architectures": [a for a in text.get("architectures") or [] if a in ARCHITECTURES],
                  "model_type": text.get("model_type", "deepseek_v3")})
    if arch != "v3":
        raise ConfigError(f"Kimi-K2.5's text_config must be a DeepSeek-V3 model (model_type 'kimi_k2' or "
                          f"'deepseek_v3'), got model_type {text.get('model_type')!r}")
    return dataclasses.replace(_parse(text, arch), wrapper="kimi_k25")


def _parse(raw: dict[str, Any], arch: str) -> ModelConfig:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act' = {act!r} is not supported (supported: silu)")
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    max_pos = _int(raw, "max_position_embeddings", 4096)
    rope_dim = _int(raw, "qk_rope_head_dim")
    if rope_dim % 2:
        raise ConfigError(f"config field 'qk_rope_head_dim' must be even, got {rope_dim}")
    eps = float(raw.get("rms_norm_eps", 1e-6))
    # GLM-lite's rotary reads partial_rotary_factor; MLA's rope channels are all rotated (qk_rope_head_dim)
    for where in (raw, raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}):
        prf = where.get("partial_rotary_factor", 1.0) if isinstance(where, dict) else 1.0
        if prf not in (None, 1, 1.0):
            raise ConfigError(f"config field 'partial_rotary_factor' = {prf!r} is not supported: MLA rotates all "
                              f"qk_rope_head_dim ({rope_dim}) channels (1.0)")
    q_lora = _int(raw, "q_lora_rank", None, allow_none=True)
    mla = MLAConfig(
        hidden_size=hidden, num_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
        v_head_dim=_int(raw, "v_head_dim"),
        # the latent norms (q_a/kv_a_layernorm) keep eps 1e-6 whatever rms_norm_eps says, as DeepSeek's
        # reference and transformers build them (GLM-lite's 1e-5 is the decoder norms' only)
        rope=_rope(raw, arch, rope_dim, max_pos), rms_norm_eps=1e-6,
        attention_bias=bool(raw.get("attention_bias", False)))
    n_routed = _int(raw, "n_routed_experts", None, allow_none=True)
    moe = None
    if n_routed is not None:
        # transformers does not write topk_method/scoring_func for V3: V3 is sigmoid + noaux_tc.
        defaults = ("noaux_tc", "sigmoid") if arch in V3_ROUTING else ("greedy", "softmax")
        topk_method = raw.get("topk_method") or defaults[0]
        scoring = raw.get("scoring_func") or defaults[1]
        n_group = _int(raw, "n_group", 1) or 1
        try:
            moe = MoEConfig(
                hidden_size=hidden, moe_intermediate_size=_int(raw, "moe_intermediate_size"),
                n_routed_experts=n_routed, n_shared_experts=_int(raw, "n_shared_experts", 0, lo=0) or 0,
                top_k=_int(raw, "num_experts_per_tok"), n_group=n_group,
                topk_group=_int(raw, "topk_group", n_group) or n_group,
                topk_method=topk_method, scoring_func=scoring,
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    layers = _int(raw, "num_hidden_layers")
    first_dense, mlp_types = _mlp_layer_types(raw, arch, layers)
    return ModelConfig(
        arch=arch, vocab_size=_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"), num_hidden_layers=layers,
        first_k_dense_replace=first_dense, moe_layer_freq=_int(raw, "moe_layer_freq", 1) or 1,
        max_position_embeddings=max_pos, rms_norm_eps=eps,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mla=mla, moe=moe, quant=_quant(raw),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0, lo=0) or 0,
        eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id"),
        dsa=_dsa(raw, rope_dim, q_lora) if arch == "v32" else None, mlp_layer_types=mlp_types)

