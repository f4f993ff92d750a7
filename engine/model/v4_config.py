"""DeepSeek-V4 (DeepseekV4ForCausalLM) config.json, in either spelling, -> ModelConfig with `v4` set.

Two spellings of the same facts:
  transformers >= 5.24: `layer_types` ("sliding_attention" | "compressed_sparse_attention" |
      "heavily_compressed_attention"), `compress_rates` {type: m}, `mlp_layer_types` ("hash_moe" | "moe"),
      `rope_parameters` {"main": {...}, "compress": {...}}, `partial_rotary_factor`;
  DeepSeek's: `compress_ratios` (per layer 0 | m, possibly one more for the MTP layer), `compress_rate_csa` /
      `compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`, `rope_theta` + `compress_rope_theta` and a
      `rope_scaling` (YaRN) that applies to the compress table only, its cos/sin unscaled (attention_factor 1).
Every layer is MoE (the first hash-routed), with one shared expert of moe_intermediate_size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wideep.attention_mla.config import RopeConfig
from wideep.attention_v4.config import KINDS, V4AttentionConfig
from wideep.moe.config import MoEConfig

from .config_fields import ConfigError, config_int

LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
               "heavily_compressed_attention": "hca"}
MLP_TYPES = ("hash_moe", "moe")


@dataclass(frozen=True)
class V4Config:
    """The parts of DeepSeek-V4 that are not V3's. L layers; kinds: attention_v4.config.KINDS per layer."""
    attention: V4AttentionConfig
    layer_kinds: tuple[str, ...]         # [L] "sliding" | "csa" | "hca"
    hash_layers: tuple[bool, ...]        # [L] the MoE routes by tid2eid[token id] (hash MoE)
    hc_mult: int = 4                     # residual streams (manifold-constrained hyper-connections)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # [num_nextn_predict_layers] the MTP blocks' attention kinds, as DeepSeek's compress_ratios lists them past the
    # L layers; a block it does not list is sliding-window only (as V4-Flash's is)
    mtp_layer_kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.layer_kinds) != len(self.hash_layers):
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {len(self.hash_layers)} MLP kinds")
        bad = [k for k in (*self.layer_kinds, *self.mtp_layer_kinds) if k not in KINDS]
        if bad:
            raise ValueError(f"layer kinds {bad} are not among {KINDS}")


def _layer_kinds(raw: dict[str, Any], n: int) -> tuple[tuple[str, ...], int, int]:
    """-> (kinds [n], csa ratio, hca ratio)."""
    rates = raw.get("compress_rates")
    if rates is not None and not isinstance(rates, dict):
        raise ConfigError(f"config field 'compress_rates' must be an object, got {rates!r}")
    rates = dict(rates or {})
    csa = rates.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4))
    hca = rates.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128))
    for name, v in (("compressed_sparse_attention", csa), ("heavily_compressed_attention", hca)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"config field 'compress_rates.{name}' must be an int >= 1, got {v!r}")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"config field 'layer_types' must list one of {sorted(LAYER_TYPES)} for each of "
                                 f"the {n} layers, got {types!r}")
        return tuple(LAYER_TYPES[t] for t in types), csa, hca
    ratios = raw.get("compress_ratios")
    if ratios is None:   # transformers' default: V4-Pro's order (2 HCA, then CSA / HCA alternating)
        return tuple(["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))]), csa, hca
    if not isinstance(ratios, list) or len(ratios) < n or any(isinstance(r, bool) or not isinstance(r, int)
                                                              for r in ratios):
        raise ConfigError(f"config field 'compress_ratios' must list an int for each of the {n} layers, "
                             f"got {ratios!r}")
    # entries past num_hidden_layers are the MTP layers'
    others = sorted({r for r in ratios[:n] if r not in (0, csa)})
    if len(others) > 1 or (others and "compress_rate_hca" in raw and others[0] != hca):
        raise ConfigError(f"config field 'compress_ratios' {ratios[:n]}: every compressed layer must use the CSA "
                             f"ratio ({csa}) or one HCA ratio ({hca if 'compress_rate_hca' in raw else 'any'}), "
                             f"got {others}")
    hca = others[0] if others else hca
    return tuple("sliding" if r == 0 else "csa" if r == csa else "hca" for r in ratios[:n]), csa, hca


def _mtp_kinds(raw: dict[str, Any], n: int, csa: int, hca: int) -> tuple[str, ...]:
    """[num_nextn_predict_layers] the MTP blocks' kinds: DeepSeek's compress_ratios entries past the n layers, and
    sliding-window for a block they do not list (transformers' spelling lists none)."""
    nextn = config_int(raw, "num_nextn_predict_layers", 0, lo=0) or 0
    extra = [] if raw.get("layer_types") is not None else (raw.get("compress_ratios") or [])[n:n + nextn]
    bad = [r for r in extra if r not in (0, csa, hca)]
    if bad:
        raise ConfigError(f"config field 'compress_ratios': the MTP entries {extra} must be 0, the CSA ratio "
                             f"({csa}) or the HCA ratio ({hca}), got {bad}")
    kinds = ["sliding" if r == 0 else "csa" if r == csa else "hca" for r in extra]
    return tuple(kinds + ["sliding"] * (nextn - len(kinds)))


def _hash_layers(raw: dict[str, Any], n: int) -> tuple[bool, ...]:
    types = raw.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in MLP_TYPES for t in types):
            raise ConfigError(f"config field 'mlp_layer_types' must list 'hash_moe' or 'moe' for each of the "
                                 f"{n} layers, got {types!r}")
        return tuple(t == "hash_moe" for t in types)
    k = config_int(raw, "num_hash_layers", 3, lo=0)
    return tuple(i < k for i in range(n))


def _table(params: dict[str, Any], where: str, dim: int, theta: float, legacy_yarn: bool) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(dim=dim, theta=theta)
    if kind != "yarn":
        raise ConfigError(f"config field '{where}.rope_type' = {kind!r} is not supported (supported: default, yarn)")
    if "original_max_position_embeddings" not in params or params.get("factor") is None:
        raise ConfigError(f"config field '{where}' needs 'factor' and 'original_max_position_embeddings' for yarn")
    af = params.get("attention_factor")
    # DeepSeek's reference leaves cos/sin unscaled; transformers writes attention_factor 1.0 for it
    af = 1.0 if af is None and legacy_yarn else af
    return RopeConfig(dim=dim, theta=theta, kind="yarn", factor=float(params["factor"]),
                      original_max_position=int(params["original_max_position_embeddings"]),
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      mscale=float(params.get("mscale") or 1.0),
                      mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                      attention_factor=None if af is None else float(af))


def _ropes(raw: dict[str, Any], head_dim: int) -> tuple[int, RopeConfig, RopeConfig]:
    """-> (rope dim, main table, compress table)."""
    if "qk_rope_head_dim" in raw:
        dim = config_int(raw, "qk_rope_head_dim")
    else:
        prf = raw.get("partial_rotary_factor")
        prf = 64 / 512 if prf is None else prf
        if not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ConfigError(f"config field 'partial_rotary_factor' must be in (0, 1], got {prf!r}")
        dim = int(head_dim * prf)
    rp = raw.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        tables = []
        for name in ("main", "compress"):
            p = rp[name]
            prf = p.get("partial_rotary_factor")
            if prf is not None and int(head_dim * prf) != dim:
                raise ConfigError(f"config field 'rope_parameters.{name}.partial_rotary_factor' ({prf}) rotates "
                                     f"{int(head_dim * prf)} channels, the model {dim}")
            tables.append(_table(p, f"rope_parameters.{name}", dim, float(p.get("rope_theta", 10000.0)), False))
        return dim, tables[0], tables[1]
    scaling = raw.get("rope_scaling") or {k: v for k, v in rp.items() if k not in ("main", "compress")}
    if not isinstance(scaling, dict):
        raise ConfigError(f"config field 'rope_scaling' must be an object, got {scaling!r}")
    main = RopeConfig(dim=dim, theta=float(raw.get("rope_theta", 10000.0)))
    compress = _table(scaling, "rope_scaling", dim, float(raw.get("compress_rope_theta", 160000.0)), True)
    return dim, main, compress


def _check_quant(raw: dict[str, Any]) -> None:
    """DeepSeek-V4's releases: FP8 e4m3 linears with ue8m0 128x128 block scales, routed experts FP4 (e2m1, an e8m0
    scale per 32) or FP8. The loader dequantises the FP8 linears (engine/model/loader.py); FP4 routed experts stay
    packed on the CPU backend (engine/model/v4_family.py V4Family._experts), else are dequantised too."""
    q = raw.get("quantization_config")
    if not q:
        return
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise ConfigError(f"config field 'quantization_config.quant_method' must be 'fp8' for DeepSeek-V4, "
                             f"got {q.get('quant_method') if isinstance(q, dict) else q!r}")
    for key, allowed in (("fmt", ("e4m3",)), ("scale_fmt", ("ue8m0", "float")), ("expert_dtype", ("fp8", "fp4"))):
        if q.get(key) is not None and q[key] not in allowed:
            raise ConfigError(f"config field 'quantization_config.{key}' = {q[key]!r} is not supported "
                                 f"(supported: {', '.join(allowed)})")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config field 'quantization_config.weight_block_size' must be two positive ints, "
                             f"got {block!r}")


def parse_v4(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the ModelConfig fields of a DeepSeek-V4 checkpoint (model_config.ModelConfig.from_dict builds it)."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act' = {act!r} is not supported (supported: silu)")
    _check_quant(raw)
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("DeepSeek-V4 with 'attention_bias' or 'mlp_bias' is not supported (the released models "
                             "have neither)")
    if config_int(raw, "num_key_value_heads", 1) != 1:
        raise ConfigError(f"DeepSeek-V4 attention has one shared KV head: config field 'num_key_value_heads' must "
                             f"be 1, got {raw['num_key_value_heads']!r}")
    n = config_int(raw, "num_hidden_layers")
    hidden, head_dim = config_int(raw, "hidden_size"), config_int(raw, "head_dim", 512)
    eps = float(raw.get("rms_norm_eps", 1e-6))
    rope_dim, main, compress = _ropes(raw, head_dim)
    kinds, csa, hca = _layer_kinds(raw, n)
    scoring = raw.get("scoring_func") or "sqrtsoftplus"
    shared = config_int(raw, "n_shared_experts", 1, lo=0)
    if shared != 1:
        raise ConfigError(f"DeepSeek-V4 has one shared expert: config field 'n_shared_experts' must be 1, "
                             f"got {shared}")
    limit = raw.get("swiglu_limit", 10.0)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ConfigError(f"config field 'swiglu_limit' must be a number > 0 or null, got {limit!r}")
    try:
        attention = V4AttentionConfig(
            hidden_size=hidden, num_heads=config_int(raw, "num_attention_heads"), head_dim=head_dim, rope_dim=rope_dim,
            q_lora_rank=config_int(raw, "q_lora_rank"), o_groups=config_int(raw, "o_groups"),
            o_lora_rank=config_int(raw, "o_lora_rank"), sliding_window=config_int(raw, "sliding_window", 128),
            rope_main=main, rope_compress=compress, csa_ratio=csa, hca_ratio=hca,
            index_n_heads=config_int(raw, "index_n_heads", 64), index_head_dim=config_int(raw, "index_head_dim", 128),
            index_topk=config_int(raw, "index_topk", 512), rms_norm_eps=eps)
        moe = MoEConfig(hidden_size=hidden, moe_intermediate_size=config_int(raw, "moe_intermediate_size"),
                        n_routed_experts=config_int(raw, "n_routed_experts"), n_shared_experts=1,
                        top_k=config_int(raw, "num_experts_per_tok"), n_group=1, topk_group=1,
                        topk_method="noaux_tc", scoring_func=scoring,
                        # transformers' and DeepSeek's V4 routers renormalise the top-k whatever norm_topk_prob says
                        norm_topk_prob=True, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
                        swiglu_limit=None if limit is None else float(limit))
        v4 = V4Config(attention=attention, layer_kinds=kinds, hash_layers=_hash_layers(raw, n),
                      hc_mult=config_int(raw, "hc_mult", 4), hc_sinkhorn_iters=config_int(raw, "hc_sinkhorn_iters", 20),
                      hc_eps=float(raw.get("hc_eps", 1e-6)), mtp_layer_kinds=_mtp_kinds(raw, n, csa, hca))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config: {e}") from None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return dict(
        arch="v4", vocab_size=config_int(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=moe.moe_intermediate_size, num_hidden_layers=n, first_k_dense_replace=0, moe_layer_freq=1,
        max_position_embeddings=config_int(raw, "max_position_embeddings", 1048576), rms_norm_eps=eps,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), mla=None, moe=moe, quant=None,
        num_nextn_predict_layers=config_int(raw, "num_nextn_predict_layers", 0, lo=0) or 0, eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"), v4=v4)
