"""Model config parsed from a HF `config.json` of DeepseekV2/V3ForCausalLM (Kimi-K2, Moonlight use V3)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from attention_mla.config import MLAConfig, RopeConfig
from moe.config import MoEConfig

ARCHITECTURES = {"DeepseekV2ForCausalLM": "v2", "DeepseekV3ForCausalLM": "v3"}
MODEL_TYPES = {"deepseek_v2": "v2", "deepseek_v3": "v3", "kimi_k2": "v3"}


class ConfigError(ValueError):
    """A config.json value wideep cannot serve; the message names the field."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8"
    weight_block_size: tuple[int, int]


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "v2" | "v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    num_hidden_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    mla: MLAConfig
    moe: MoEConfig | None  # None: a dense model (n_routed_experts null)
    quant: QuantConfig | None
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return (self.moe is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

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
        return _parse(raw)


def _arch(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if archs:
        raise ConfigError(f"architectures {archs} is not supported; wideep serves {sorted(ARCHITECTURES)}")
    mt = raw.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ConfigError(f"config has no supported 'architectures' (got {archs}) or 'model_type' (got {mt!r}); "
                      f"wideep serves {sorted(ARCHITECTURES)}")


def _int(raw: dict[str, Any], key: str, default: Any = ..., *, lo: int = 1, allow_none: bool = False) -> Any:
    if key not in raw or (raw[key] is None and not allow_none):
        if default is ...:
            raise ConfigError(f"config field '{key}' is missing")
        return default
    v = raw[key]
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"config field '{key}' must be an int >= {lo}, got {v!r}")
    return v


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


def _parse(raw: dict[str, Any]) -> ModelConfig:
    arch = _arch(raw)
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
    mla = MLAConfig(
        hidden_size=hidden, num_heads=heads,
        q_lora_rank=_int(raw, "q_lora_rank", None, allow_none=True),
        kv_lora_rank=_int(raw, "kv_lora_rank"),
        qk_nope_head_dim=_int(raw, "qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
        v_head_dim=_int(raw, "v_head_dim"),
        rope=_rope(raw, arch, rope_dim, max_pos), rms_norm_eps=eps,
        attention_bias=bool(raw.get("attention_bias", False)))
    n_routed = _int(raw, "n_routed_experts", None, allow_none=True)
    moe = None
    if n_routed is not None:
        # transformers does not write topk_method/scoring_func for V3: V3 is sigmoid + noaux_tc.
        defaults = ("noaux_tc", "sigmoid") if arch == "v3" else ("greedy", "softmax")
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
    first_dense = _int(raw, "first_k_dense_replace", 0, lo=0) or 0
    if first_dense > layers:
        raise ConfigError(f"config field 'first_k_dense_replace' ({first_dense}) > num_hidden_layers ({layers})")
    return ModelConfig(
        arch=arch, vocab_size=_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"), num_hidden_layers=layers,
        first_k_dense_replace=first_dense, moe_layer_freq=_int(raw, "moe_layer_freq", 1) or 1,
        max_position_embeddings=max_pos, rms_norm_eps=eps,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mla=mla, moe=moe, quant=_quant(raw),
        num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0, lo=0) or 0,
        eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id"))
