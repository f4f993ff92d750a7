"""Run-config files (TOML): model, parallel sizes, engine options, EPLB/DBO sections, what to run.

The same file works single-process and under torchrun/mpirun: dp_size/ep_size default to
"auto" (the launcher's world size). CLI flags (launch/cli/options.py) override file values; a file used
with a model given on the command line may leave out [model] path.

    [model]    path, dtype, max_model_len, experts_backend (auto|torch|triton|deepgemm),
               attention_backend (auto|torch|triton), quantization (auto|fp8|none)
    [parallel] dp_size, ep_size ("auto" | int), backend, dispatch_backend, num_redundant_experts, timeout_s,
               heartbeat_s, ranks_per_node, torch_low_latency_max_tokens, deepep_low_latency_max_tokens,
               simulated_latency_us, simulated_gbps, simulated_inter_node_latency_us,
               simulated_inter_node_gbps (parallel/config.py)
    [engine]   block_size, kv_cache_blocks, kv_cache_memory, kv_cache_dtype (auto|fp8|fp4), max_num_seqs,
               max_num_batched_tokens, seed,
               enable_prefix_caching, max_logprobs (20)
    [eplb]     enabled, window_size, step_interval, num_redundant_experts, policy, initial_placement,
               migration_aware, transfer_layers_per_step (eplb/config.py)
    [dbo]      enabled (true | false | "auto"), decode_token_threshold, prefill_token_threshold
    [speculative] method ("ngram"), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max,
               disable_by_batch_size, min_acceptance, backoff_steps (engine/spec_decode/config.py)
    [kv_cache] tiers ([] | ["host"] | ["host", "disk"]), host_bytes, disk_bytes, disk_dir, persist_on_close,
               routing ("kv_aware" | "least_loaded"), route_prefix_weight, route_load_weight (kvstore/config.py)
    [run]      prompt_ids (list of lists), prompts (list of strings), max_tokens, temperature, top_p, top_k, seed
    [server]   for `wideep serve`: host (127.0.0.1), port (8000), model_name (a name or a list of names;
               default: the checkpoint dir's name), api_key (clients send `Authorization: Bearer KEY` to
               /v1/*; also WIDEEP_API_KEY), protect_metrics (false: /metrics open even with an api_key),
               allowed_origins (CORS: a list of origins, "*" any; default none: off)
    [disagg]   kv_transfer, idle_sleep_s; [disagg.prefill] / [disagg.decode]: dp_size, ep_size, max_num_seqs,
               max_num_batched_tokens, kv_cache_blocks (disagg/config.py). Present = prefill/decode pools.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class ServerSection:
    """[server], for `wideep serve`."""
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | list[str] | None = None     # several: all accepted, the first reported
    api_key: str | None = None
    protect_metrics: bool = False
    allowed_origins: list[str] | None = None      # CORS; None: off
    chat_template: str | None = None        # launch/server/chat_http.OPTIONS
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tokenizer_mode: str | None = None       # "auto" | "deepseek_v32" | "deepseek_v4" (launch/chat/chat_template.py)

    def __post_init__(self):
        for key in ("model_name", "allowed_origins"):
            v = getattr(self, key)
            if isinstance(v, list) and (not v or not all(isinstance(x, str) and x for x in v)):
                raise ValueError(f"[server] {key} must be a non-empty list of non-empty strings, got {v!r}")
        if isinstance(self.allowed_origins, str):
            raise ValueError(f"[server] allowed_origins must be a list of strings, got {self.allowed_origins!r}")
        for key in ("host", "model_name", "api_key"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, list) and (not isinstance(v, str) or not v):
                got = repr(v) if key != "api_key" else f"a {type(v).__name__}"  # never echo a secret
                raise ValueError(f"[server] {key} must be a non-empty string, got {got}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"[server] port must be an int in [0, 65535], got {self.port!r}")
        if not isinstance(self.protect_metrics, bool):
            raise ValueError(f"[server] protect_metrics must be true or false, got {self.protect_metrics!r}")


@dataclass(frozen=True)
class RunSection:
    """[run], what `wideep run` generates."""
    prompt_ids: tuple = ()
    prompts: tuple = ()
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None


def _sections() -> dict[str, set[str]]:
    """Every section's keys, from the dataclasses that parse them (never a hand-kept list)."""
    from wideep.disagg.config import DisaggConfig
    from wideep.engine.engine_config import EngineConfig
    out = EngineConfig.section_keys()
    for name, cls in (("server", ServerSection), ("run", RunSection), ("disagg", DisaggConfig)):
        out[name] = {f.name for f in dataclasses.fields(cls)}
    return out


SECTIONS: dict[str, set[str]] = _sections()


def validate(cfg: dict[str, Any], source: str = "run config", require_model: bool = True) -> dict[str, Any]:
    """Check every section and key, then parse each section with its own dataclass (the one strict
    parser the engine uses too), so a value that would fail at start-up fails here, naming it."""
    for section, body in cfg.items():
        if section not in SECTIONS:
            raise ValueError(f"{source}: unknown section [{section}] (known: {sorted(SECTIONS)})")
        if not isinstance(body, dict):
            raise ValueError(f"{source}: [{section}] must be a table")
        unknown = sorted(set(body) - SECTIONS[section])
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown} in [{section}] (known: {sorted(SECTIONS[section])})")
    if require_model and "path" not in cfg.get("model", {}):
        raise ValueError(f"{source}: [model] path is required")
    from wideep.engine.engine_config import EngineConfig
    sections = dict(cfg, model=dict(cfg.get("model", {})))
    sections["model"].setdefault("path", "<given on the command line>")
    from wideep.disagg.config import DisaggConfig
    parsers = [("", lambda: EngineConfig.from_sections(sections, world_size=1)),
               ("[server] ", lambda: ServerSection(**cfg.get("server", {}))),
               ("[run] ", lambda: RunSection(**cfg.get("run", {}))),
               ("[disagg] ", lambda: DisaggConfig.from_dict(cfg["disagg"]) if "disagg" in cfg else None)]
    for section, parse in parsers:
        try:
            parse()
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise ValueError(f"{source}: {'' if msg.startswith(section) else section}{msg}") from None
    return cfg


def load(path: str, require_model: bool = True) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"run config {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"run config {path!r} is not valid TOML: {e}") from None
    return validate(cfg, path, require_model)


def override(cfg: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """flags named section__key (e.g. parallel__ep_size=4); None values are ignored."""
    out = copy.deepcopy(cfg)
    for name, value in flags.items():
        if value is None:
            continue
        section, key = name.split("__", 1)
        if key == "*":   # a whole section's keys (--speculative-config JSON)
            out.setdefault(section, {}).update(value)
        else:
            out.setdefault(section, {})[key] = value
    return validate(out, "run config + flags")


def sampling_params(cfg: dict[str, Any]):
    """SamplingParams from [run] (temperature 0, max_tokens 16 unless set)."""
    from wideep.engine.sampling_params import SamplingParams
    r = cfg.get("run", {})
    return SamplingParams(temperature=r.get("temperature", 0.0), top_p=r.get("top_p", 1.0), top_k=r.get("top_k", -1),
                          max_tokens=r.get("max_tokens", 16), seed=r.get("seed"))


def llm_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """LLM(**kwargs) from a validated run config: [model] and [engine] keys are EngineConfig's
    option names (path -> model); [parallel] / [eplb] / [dbo] / [disagg] go in as dicts."""
    kw: dict[str, Any] = {"progress": False}
    for section in ("model", "engine"):
        for k, v in cfg.get(section, {}).items():
            kw["model" if k == "path" else k] = v
    kw["parallel"] = {k: v for k, v in cfg.get("parallel", {}).items() if v != "auto"}
    for section in ("eplb", "dbo", "disagg", "speculative"):
        if cfg.get(section) or (section == "disagg" and section in cfg):
            kw[section] = dict(cfg[section])
    return kw
