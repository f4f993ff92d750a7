"""EngineConfig: every option of an engine, frozen and validated once, fingerprinted whole.

One source for three readers: `Engine(model, **options)` / `LLM(...)` keywords, the run-config file
(each field names its section: [model] or [engine]; [parallel], [dbo], [eplb], [kv_cache], [speculative] are the nested
configs' own fields) and the cross-rank agreement check (every rank must hold an equal config).
Keys are derived from the dataclass fields, never listed by hand.

    cfg = EngineConfig.from_options("path/to/hf_dir", max_num_seqs=64, parallel={"ep_size": 4})
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from wideep.dbo.overlap import DboConfig
from wideep.eplb.config import EplbConfig
from wideep.kvstore.config import KVCacheConfig
from wideep.parallel.config import ParallelConfig

from .spec_decode.config import SpeculativeConfig


def _f(section: str, default: Any, doc: str):
    return field(default=default, metadata={"section": section, "doc": doc})


@dataclass(frozen=True)
class EngineConfig:
    model: str = _f("model", None, "the HF checkpoint directory (run config: [model] path)")
    dtype: str = _f("model", "float32", "float32 | bfloat16 (CPU: the kernels read bf16 weights as stored; GPU) | "
                                        "float16 (GPU)")
    device: str | None = _f("model", None, "default: cuda when present, else cpu")
    max_model_len: int | None = _f("model", None, "context length; default max_position_embeddings")
    experts_backend: str = _f("model", "auto", "auto | torch | cpu | triton | deepgemm")
    attention_backend: str = _f("model", "auto", "auto | torch | cpu | triton")
    quantization: str = _f("model", "auto", "an fp8 checkpoint's weights in memory: auto (fp8 where the experts "
                                            "backend computes on fp8: cpu, triton, deepgemm; DeepSeek-V4's FP4 "
                                            "experts packed on the cpu backend) | fp8 | fp4 (V4's FP4 experts as "
                                            "stored, or an error) | none (dequantised at load into dtype)")
    fuse_decode_stack: bool = _f("model", True, "CPU kernels: a decode step's decoder layers in one C call "
                                               "when each can be (off: a fused call per layer half)")
    block_size: int = _f("engine", 64, "tokens per KV cache block")
    kv_cache_blocks: int | None = _f("engine", None, "blocks per rank; default: enough for max_num_seqs "
                                                     "full-length sequences, capped by kv_cache_memory")
    kv_cache_memory: int = _f("engine", 1 << 30, "bytes of KV cache per rank when kv_cache_blocks is unset")
    kv_cache_dtype: str = _f("engine", "auto", "auto (the model dtype) | fp8 (= fp8_e4m3): the latent cached as "
                                               "e4m3 + a float32 scale per 128 values | fp4 (= fp4_e2m1): as e2m1 + "
                                               "an e4m3 scale per 16 values and a float32 one per token; the RoPE "
                                               "part unquantised")
    max_num_seqs: int = _f("engine", 256, "most running sequences per rank")
    max_num_batched_tokens: int = _f("engine", 8192, "most tokens in one step per rank (prefill is chunked)")
    max_mixed_step_tokens: int | None = _f("engine", None, "while fewer sequences decode, a step with decodes takes "
                                                        "short prompts' tokens only up to this many tokens in all "
                                                        "(their rest next step); 0: off; default: the step size "
                                                        "the model's fused CPU path takes (64 tokens), else off")
    enable_prefix_caching: bool = _f("engine", True, "reuse cached KV blocks of shared prompt prefixes")
    max_logprobs: int = _f("engine", 20, "the most logprobs / prompt_logprobs a request may ask for")
    seed: int = _f("engine", 0, "sampling seed of requests without their own")
    structured_outputs_backend: str = _f("engine", "xgrammar", "the grammar engine of structured outputs: "
                                                              "xgrammar | guidance (llguidance)")
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"section": "parallel"})
    dbo: DboConfig = field(default_factory=DboConfig, metadata={"section": "dbo"})
    eplb: EplbConfig = field(default_factory=EplbConfig, metadata={"section": "eplb"})
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig, metadata={"section": "kv_cache"})
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig, metadata={"section": "speculative"})

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint directory path, got {self.model!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_logprobs", self.max_logprobs, 0)
        if self.max_mixed_step_tokens is not None:
            _check_int("max_mixed_step_tokens", self.max_mixed_step_tokens, 0)
        for name in ("kv_cache_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        from wideep.attention_mla.paged_decode import ATTENTION_BACKENDS
        from wideep.moe.backend import EXPERTS_BACKENDS
        for name, allowed in (("experts_backend", EXPERTS_BACKENDS), ("attention_backend", ATTENTION_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.kv_cache.tiers and not self.enable_prefix_caching:
            raise ValueError(f"kv_cache.tiers {list(self.kv_cache.tiers)} keep prefix-cache blocks: they need "
                             f"enable_prefix_caching = true")
        from wideep.structured.backend import BACKENDS
        if self.structured_outputs_backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {list(BACKENDS)}, "
                             f"got {self.structured_outputs_backend!r}")
        from wideep.attention_mla.fp8_cache import check_kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype)
        from .model.build import DTYPES
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    # -- the keys, derived ---------------------------------------------------------------------------
    @classmethod
    def section_keys(cls) -> dict[str, set[str]]:
        """Run-config section -> its keys: [model] and [engine] from this class (model -> "path"),
        the nested sections from their own dataclasses."""
        out: dict[str, set[str]] = {"model": set(), "engine": set()}
        for f in dataclasses.fields(cls):
            section = f.metadata["section"]
            if section in ("model", "engine"):
                out[section].add("path" if f.name == "model" else f.name)
            else:
                out[section] = {g.name for g in dataclasses.fields(_NESTED[section])}
        return out

    @classmethod
    def from_sections(cls, sections: dict[str, dict], world_size: int | None = None) -> "EngineConfig":
        """From run-config sections ([model], [engine], [parallel], [dbo], [eplb], [kv_cache]); others ignored.
        Unknown keys are an error naming the section. dp_size / ep_size "auto" or absent: world_size
        (default: the launcher's)."""
        keys = cls.section_keys()
        flat: dict[str, Any] = {}
        for section in ("model", "engine"):
            body = sections.get(section, {})
            _unknown(section, body, keys[section])
            for k, v in body.items():
                flat["model" if k == "path" else k] = v
        for section, typ in _NESTED.items():
            body = dict(sections.get(section, {}))
            _unknown(section, body, keys[section])
            if section == "parallel":
                body = _sizes(body, world_size)
            flat[section] = _build(typ, body, section)
        return cls(**flat)

    @classmethod
    def from_options(cls, model: str, world_size: int | None = None, **options) -> "EngineConfig":
        """From Engine/LLM keywords: the fields, plus dp_size / ep_size / dispatch_backend as
        shortcuts into `parallel` (a ParallelConfig or dict), dbo as True/False/"auto" or a dict,
        eplb / kv_cache / speculative as their config or a dict (speculative_config: vLLM's name).
        dp_size / ep_size not given (or "auto"): world_size (default: the launcher's)."""
        options = dict(options)
        par = options.pop("parallel", None)
        par = par.to_dict() if isinstance(par, ParallelConfig) else dict(par or {})
        for key in ("dp_size", "ep_size", "dispatch_backend"):
            v = options.pop(key, None)
            if v is not None:
                par[key] = v
        if "speculative_config" in options:
            if "speculative" in options:
                raise ValueError("give speculative or speculative_config, not both")
            options["speculative"] = options.pop("speculative_config")
        known = {f.name for f in dataclasses.fields(cls)} - {"model", "parallel"}
        unknown = sorted(set(options) - known)
        if unknown:
            shortcuts = {"parallel", "dp_size", "ep_size", "dispatch_backend", "speculative_config"}
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(known | shortcuts)}")
        if "dbo" in options:
            options["dbo"] = DboConfig.coerce(options["dbo"])
        if "eplb" in options:
            options["eplb"] = EplbConfig.coerce(options["eplb"])
        if "kv_cache" in options:
            options["kv_cache"] = KVCacheConfig.coerce(options["kv_cache"])
        if "speculative" in options:
            options["speculative"] = SpeculativeConfig.coerce(options["speculative"])
        if "dtype" in options and not isinstance(options["dtype"], str):  # a torch.dtype
            options["dtype"] = _dtype_name(options["dtype"])
        return cls(model=model, parallel=_build(ParallelConfig, _sizes(par, world_size), "parallel"), **options)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_NESTED = {"parallel": ParallelConfig, "dbo": DboConfig, "eplb": EplbConfig, "kv_cache": KVCacheConfig,
           "speculative": SpeculativeConfig}


def _sizes(par: dict, world_size: int | None) -> dict:
    """dp_size / ep_size that are absent or "auto" become the world size, read from the launcher's
    environment before anything connects, so one config serves 1 and N ranks."""
    if par.get("dp_size", "auto") == "auto" or par.get("ep_size", "auto") == "auto":
        if world_size is None:
            from wideep.parallel import launch_world_size
            world_size = launch_world_size()
        for key in ("dp_size", "ep_size"):
            if par.get(key, "auto") == "auto":
                par[key] = world_size
    return par


def _check_int(name: str, v, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def _unknown(section: str, body: dict, known: set[str]) -> None:
    if not isinstance(body, dict):
        raise ValueError(f"[{section}] must be a table, got {type(body).__name__}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown} in [{section}] (known: {sorted(known)})")


def _build(typ, body: dict, section: str):
    if isinstance(body, typ):
        return body
    _unknown(section, body, {f.name for f in dataclasses.fields(typ)})
    try:
        return typ(**body)
    except (TypeError, ValueError) as e:  # TypeError: a wrongly typed value the dataclass did not check
        raise ValueError(f"[{section}] {e}") from None


def _dtype_name(dtype) -> str:
    from .model.build import DTYPES
    for name, t in DTYPES.items():
        if t == dtype:
            return name
    raise ValueError(f"dtype {dtype!r} is not supported (supported: {sorted(DTYPES)})")
