"""The flags of `wideep serve` / `run` / `generate`: each one overrides one run-config key.

One table (OPTIONS) gives both the argparse flags and the run-config overrides, so a new option is
one line here plus its key in run_config.SECTIONS (a test checks that every key exists there).
`wideep serve MODEL_DIR` takes the model positionally, as `vllm serve` does; `--model` is kept.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..chat.chat_template import TOKENIZER_MODES
from ..chat.reasoning import PARSERS as REASONING_PARSERS
from ..chat.tool_parsers import PARSERS as TOOL_PARSERS

SERVE, RUN, GENERATE = "serve", "run", "generate"
ENGINE = (SERVE, RUN, GENERATE)  # what builds an engine: every command here


def _dbo(value: str):
    if value not in ("true", "auto"):
        raise argparse.ArgumentTypeError(f"--enable-dbo takes nothing, 'true' or 'auto', got {value!r}")
    return True if value == "true" else "auto"


def token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("is empty")
    return ids


def origins(text: str) -> list[str]:
    """vLLM's JSON list ('["https://a.example", "https://b.example"]'), or comma-separated origins."""
    if text.lstrip().startswith("["):
        try:
            v = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"is not a JSON list: {e}") from None
        if not isinstance(v, list) or not all(isinstance(o, str) and o for o in v):
            raise argparse.ArgumentTypeError(f"must be a JSON list of origin strings, got {text!r}")
        return v
    v = [o.strip() for o in text.split(",") if o.strip()]
    if not v:
        raise argparse.ArgumentTypeError("is empty")
    return v


def json_table(text: str) -> dict:
    """A JSON object (vLLM's --speculative-config '{"method": "ngram", ...}')."""
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"is not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return v


@dataclass(frozen=True)
class Option:
    key: str                     # "section.key" in the run config; "section.*": a JSON object of the section's keys
    help: str
    commands: tuple[str, ...] = ENGINE
    flag: str = ""               # default: --key, "_" -> "-"
    spec: dict[str, Any] = field(default_factory=dict)  # add_argument's type / action / choices ...
    aliases: tuple[str, ...] = ()  # other spellings of the flag

    @property
    def dest(self) -> str:       # run_config.override's name for the key
        return self.key.replace(".", "__")

    @property
    def name(self) -> str:
        return self.flag or "--" + self.key.split(".", 1)[1].replace("_", "-")


INT, FLOAT = {"type": int}, {"type": float}
OPTIONS: tuple[Option, ...] = (
    Option("model.path", "the checkpoint directory (same as the positional MODEL_DIR)", flag="--model"),
    Option("model.dtype", "float32 | bfloat16 | float16 (default float32)"),
    Option("model.max_model_len", "context length (default: the model's max_position_embeddings)", spec=INT),
    Option("model.experts_backend", "auto | torch | cpu | triton | deepgemm"),
    Option("model.attention_backend", "auto | torch | cpu | triton"),
    Option("model.quantization", "an fp8 checkpoint's weights in memory: auto (fp8 where the backend computes on "
           "fp8; DeepSeek-V4's FP4 experts packed on the cpu backend) | fp8 | fp4 (V4's FP4 experts as stored) | "
           "none (dequantised at load)",
           spec={"choices": ["auto", "fp8", "fp4", "none"]}),   # = engine/model/build.py QUANTIZATION
    Option("parallel.dp_size", "data-parallel ranks (default: the launcher's world size; `serve` started without a "
           "launcher starts this many local ranks itself)", spec=INT),
    Option("parallel.ep_size", "expert-parallel ranks (default: the launcher's world size)", spec=INT),
    Option("parallel.dispatch_backend", "MoE all-to-all backend",
           spec={"choices": ["auto", "torch", "hierarchical", "allgather", "deepep"]}),   # = DISPATCH_BACKENDS
    Option("engine.block_size", "KV cache block size in tokens (default 64)", spec=INT),
    Option("engine.kv_cache_blocks", "KV cache blocks per rank (default: sized from kv_cache_memory)", spec=INT),
    Option("engine.kv_cache_dtype", "auto (the model dtype) | fp8 (= fp8_e4m3) | fp4 (= fp4_e2m1): the latent "
           "KV cache's format", spec={"choices": ["auto", "fp8", "fp8_e4m3", "fp4", "fp4_e2m1"]}),
    # = attention_mla/fp8_cache.py KV_CACHE_DTYPES (tests/launch/test_options.py)
    Option("engine.max_num_seqs", "most sequences in one step per rank (default 256)", spec=INT),
    Option("engine.max_num_batched_tokens", "most tokens in one step per rank (default 8192; serve on CPU: 2048)",
           spec=INT),
    Option("engine.max_mixed_step_tokens", "a step with decodes takes short prompts' tokens up to this many tokens "
           "in all (0: off; default: the fused CPU step's size, else off)", spec=INT),
    Option("engine.enable_prefix_caching", "reuse cached KV blocks of shared prompt prefixes (default on)",
           spec={"action": argparse.BooleanOptionalAction}),
    Option("engine.max_logprobs", "the most logprobs / prompt_logprobs a request may ask for (default 20)",
           spec=INT),
    Option("engine.structured_outputs_backend", "the grammar engine of structured outputs (default xgrammar)",
           spec={"choices": ["xgrammar", "guidance"]}),   # = structured/backend.BACKENDS
    Option("engine.seed", "the engine's sampling seed (requests without their own seed)", commands=(SERVE,),
           flag="--seed", spec=INT),
    Option("eplb.enabled", "online expert load balancing ([eplb] enabled)", flag="--enable-eplb",
           spec={"action": "store_const", "const": True}),
    Option("dbo.enabled", "dual-batch overlap ([dbo] enabled); 'auto': split only where it measured faster",
           flag="--enable-dbo", spec={"nargs": "?", "const": True, "type": _dbo}),
    Option("speculative.*", "speculative decoding as JSON ([speculative] in the run config): method (ngram: "
           "prompt/output lookup | mtp: the checkpoint's MTP layer), num_speculative_tokens, prompt_lookup_min, "
           "prompt_lookup_max (ngram), draft_dtype (mtp), disable_by_batch_size, min_acceptance, backoff_steps",
           flag="--speculative-config", spec={"type": json_table}),   # = engine/spec_decode/config.py's fields
    Option("server.host", "bind address (default 127.0.0.1: this host only)", commands=(SERVE,)),
    Option("server.port", "default 8000; 0 picks a free port (printed)", commands=(SERVE,), spec=INT),
    Option("server.model_name", "the `model` names clients may pass; the first is the one responses report "
           "(default: the checkpoint dir's name)", commands=(SERVE,), flag="--served-model-name",
           aliases=("--model-name",), spec={"nargs": "+"}),
    Option("server.allowed_origins", "CORS: origins browsers may call from (JSON list or comma-separated; "
           "'*' any; default none: CORS off)", commands=(SERVE,), spec={"type": origins}),
    Option("server.api_key", "clients must send `Authorization: Bearer KEY` to /v1/* (also WIDEEP_API_KEY)",
           commands=(SERVE,)),
    Option("server.protect_metrics", "/metrics needs the API key too", commands=(SERVE,),
           spec={"action": "store_const", "const": True}),
    Option("server.chat_template", "a Jinja chat template FILE instead of the checkpoint's", commands=(SERVE,)),
    Option("server.tokenizer_mode", "the prompt format: auto (the checkpoint's template, else DeepSeek-V3.2's / "
           "V4's encoding by architecture) or one of DeepSeek's encodings", commands=(SERVE,),
           spec={"choices": list(TOKENIZER_MODES)}),
    Option("server.reasoning_parser", "split <think> reasoning into reasoning_content", commands=(SERVE,),
           spec={"choices": list(REASONING_PARSERS)}),
    Option("server.tool_call_parser", "parse tool calls of this format", commands=(SERVE,),
           spec={"choices": list(TOOL_PARSERS)}),
    Option("server.enable_auto_tool_choice", "tool_choice \"auto\": parse the model's tool calls", commands=(SERVE,),
           spec={"action": "store_const", "const": True}),
    Option("run.prompt_ids", "a prompt as comma-separated token ids (repeat for more prompts)", commands=(RUN,),
           flag="--prompt-ids", spec={"action": "append", "type": token_ids}),
    Option("run.prompts", "a text prompt (repeat for more prompts)", commands=(RUN,), flag="--prompt",
           spec={"action": "append"}),
    Option("run.max_tokens", "tokens to generate per prompt (default 16)", commands=(RUN, GENERATE), spec=INT),
    Option("run.temperature", "0 is greedy (default 0)", commands=(RUN, GENERATE), spec=FLOAT),
    Option("run.top_p", "default 1.0", commands=(RUN, GENERATE), spec=FLOAT),
    Option("run.top_k", "-1 or 0: off (default)", commands=(RUN, GENERATE), spec=INT),
    Option("run.seed", "the requests' sampling seed", commands=(RUN, GENERATE), flag="--seed", spec=INT),
)


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The positional MODEL_DIR, --config, and every option of `command`; unset ones stay None."""
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="the checkpoint directory")
    parser.add_argument("--config", help="a TOML run config (launch/cli/run_config.py); flags override its values")
    for o in OPTIONS:
        if command in o.commands:
            takes_value = o.spec.get("action") in (None, "append")
            name = o.key.split(".", 1)[1]
            meta = {"metavar": "JSON" if name == "*" else name.upper()} if takes_value and "choices" not in o.spec else {}
            parser.add_argument(o.name, *o.aliases, dest=o.dest, default=None, help=o.help, **meta, **o.spec)


def overrides(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """-> {"section__key": value} for run_config.override (None: not given)."""
    out = {o.dest: getattr(args, o.dest) for o in OPTIONS if command in o.commands}
    if args.model_dir is not None:
        if out["model__path"] not in (None, args.model_dir):
            raise ValueError(f"two models given: MODEL_DIR {args.model_dir!r} and --model {out['model__path']!r}")
        out["model__path"] = args.model_dir
    return out


def resolve(args: argparse.Namespace, command: str, env=os.environ) -> dict[str, Any]:
    """The run config of `wideep <command> args`: --config (optional) with the flags over it. serve's
    API key: --api-key, else WIDEEP_API_KEY, else [server] api_key (an env var set for the deployment
    beats a file that may be shared)."""
    from . import run_config
    cfg = run_config.load(args.config, require_model=False) if args.config else {}
    flags = overrides(args, command)
    if command == SERVE and flags["server__api_key"] is None and "WIDEEP_API_KEY" in env:
        if not env["WIDEEP_API_KEY"]:
            raise ValueError("WIDEEP_API_KEY is set but empty; unset it or give a key")
        flags["server__api_key"] = env["WIDEEP_API_KEY"]
    if flags["model__path"] is None and "path" not in cfg.get("model", {}):
        raise ValueError(f"no model: `wideep {command} MODEL_DIR` (or --model, or [model] path in --config)")
    return run_config.override(cfg, **flags)
