"""Run-config files (TOML): model, parallel sizes, engine options, EPLB/DBO sections, what to run.

The same file works single-process and under torchrun/mpirun: dp_size/ep_size default to
"auto" (the launcher's world size). CLI flags override file values.

    [model]    path, dtype, max_model_len, experts_backend (auto|torch|triton|deepgemm),
               attention_backend (auto|torch|triton)
    [parallel] dp_size, ep_size ("auto" | int), backend, dispatch_backend, num_redundant_experts, timeout_s,
               heartbeat_s, ranks_per_node, torch_low_latency_max_tokens, deepep_low_latency_max_tokens,
               simulated_latency_us, simulated_gbps (parallel/config.py)
    [engine]   block_size, kv_cache_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens, seed
    [eplb]     enabled, window_size, step_interval, num_redundant_experts, policy, initial_placement,
               migration_aware, transfer_layers_per_step (eplb/config.py)
    [dbo]      enabled (true | false | "auto"), decode_token_threshold, prefill_token_threshold
    [run]      prompt_ids (list of lists), prompts (list of strings), max_tokens, temperature, top_p, top_k, seed
    [server]   host (127.0.0.1), port (8000), model_name (default: the checkpoint dir's name) for `wideep serve`
    [disagg]   kv_transfer, idle_sleep_s; [disagg.prefill] / [disagg.decode]: dp_size, ep_size, max_num_seqs,
               max_num_batched_tokens, kv_cache_blocks (disagg/config.py). Present = prefill/decode pools.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from dbo.overlap import DboConfig
from eplb.config import EplbConfig
from parallel.config import ParallelConfig

SECTIONS: dict[str, set[str]] = {
    "model": {"path", "dtype", "max_model_len", "experts_backend", "attention_backend"},
    "parallel": {f.name for f in dataclasses.fields(ParallelConfig)},
    "engine": {"block_size", "kv_cache_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "seed",
               "enable_prefix_caching"},
    "eplb": {f.name for f in dataclasses.fields(EplbConfig)},
    "dbo": {f.name for f in dataclasses.fields(DboConfig)},
    "run": {"prompt_ids", "prompts", "max_tokens", "temperature", "top_p", "top_k", "seed"},
    "server": {"host", "port", "model_name"},
    "disagg": {"prefill", "decode", "kv_transfer", "idle_sleep_s"},
}


def validate(cfg: dict[str, Any], source: str = "run config") -> dict[str, Any]:
    for section, body in cfg.items():
        if section not in SECTIONS:
            raise ValueError(f"{source}: unknown section [{section}] (known: {sorted(SECTIONS)})")
        if not isinstance(body, dict):
            raise ValueError(f"{source}: [{section}] must be a table")
        unknown = sorted(set(body) - SECTIONS[section])
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown} in [{section}] (known: {sorted(SECTIONS[section])})")
    if "eplb" in cfg:
        try:
            EplbConfig.from_dict(cfg["eplb"])
        except ValueError as e:
            raise ValueError(f"{source}: [eplb] {e}") from None
    if "dbo" in cfg:
        try:
            DboConfig(**cfg["dbo"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: [dbo] {e}") from None
    from attention_mla.paged_decode import ATTENTION_BACKENDS
    from moe.backend import EXPERTS_BACKENDS
    for key, allowed in (("experts_backend", EXPERTS_BACKENDS), ("attention_backend", ATTENTION_BACKENDS)):
        value = cfg.get("model", {}).get(key, "auto")
        if value not in allowed:
            raise ValueError(f"{source}: [model] {key} = {value!r} is not one of {allowed}")
    if "disagg" in cfg:
        from disagg.config import DisaggConfig
        try:
            DisaggConfig.from_dict(cfg["disagg"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: [disagg] {e}") from None
    if "path" not in cfg.get("model", {}):
        raise ValueError(f"{source}: [model] path is required")
    return cfg


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"run config {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"run config {path!r} is not valid TOML: {e}") from None
    return validate(cfg, path)


def override(cfg: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """flags named section__key (e.g. parallel__ep_size=4); None values are ignored."""
    out = copy.deepcopy(cfg)
    for name, value in flags.items():
        if value is None:
            continue
        section, key = name.split("__", 1)
        out.setdefault(section, {})[key] = value
    return validate(out, "run config + flags")


def llm_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """LLM(**kwargs) from a validated run config."""
    m, e = cfg["model"], cfg.get("engine", {})
    par = {k: v for k, v in cfg.get("parallel", {}).items() if v != "auto"}
    eplb = {"eplb": dict(cfg["eplb"])} if cfg.get("eplb") else {}
    dbo = {"dbo": dict(cfg["dbo"])} if cfg.get("dbo") else {}
    backends = {k: m[k] for k in ("experts_backend", "attention_backend") if k in m}
    disagg = {"disagg": dict(cfg["disagg"])} if "disagg" in cfg else {}
    return dict(model=m["path"], dtype=m.get("dtype", "float32"), max_model_len=m.get("max_model_len"),
                parallel=par, progress=False, **backends, **eplb, **dbo, **disagg, **e)
