"""The flag table (launch/cli/options.py): every flag is a run-config key; `wideep serve|run|generate
MODEL_DIR` works without a config; flags override the file; the API key comes from flag > env > file."""
from __future__ import annotations

import json

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.launch.cli import run_config
from wideep.launch.cli.main import build_parser, main
from wideep.launch.cli.options import OPTIONS, SERVE, resolve
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

CONFIG = """
[model]
path = "/from-file"
dtype = "float32"
[engine]
enable_prefix_caching = true
max_logprobs = 20
block_size = 16
[server]
port = 8000
model_name = "file-name"
api_key = "file-key"
"""


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def _cfg_file(tmp_path, text: str = CONFIG) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_every_flag_is_a_run_config_key():
    for o in OPTIONS:
        section, key = o.key.split(".", 1)
        assert key == "*" and section in run_config.SECTIONS or key in run_config.SECTIONS[section], o.key
    flags = [(c, o.name) for o in OPTIONS for c in o.commands]
    assert len(flags) == len(set(flags))  # no flag twice in one command


def test_dispatch_backend_choices_are_the_configs():
    """launch/cli/options.py lists them literally (no torch import for `wideep --help`)."""
    from wideep.parallel.config import DISPATCH_BACKENDS
    [opt] = [o for o in OPTIONS if o.key == "parallel.dispatch_backend"]
    assert opt.spec["choices"] == list(DISPATCH_BACKENDS)


def test_kv_cache_dtype_choices_are_the_caches():
    from wideep.attention_mla.fp8_cache import KV_CACHE_DTYPES
    [opt] = [o for o in OPTIONS if o.key == "engine.kv_cache_dtype"]
    assert opt.spec["choices"] == list(KV_CACHE_DTYPES)
    args = build_parser().parse_args(["generate", "m", "--kv-cache-dtype", "fp8"])
    assert resolve(args, "generate")["engine"]["kv_cache_dtype"] \
        == "fp8"
    args = build_parser().parse_args(["generate", "m", "--kv-cache-dtype", "fp4"])
    assert resolve(args, "generate")["engine"]["kv_cache_dtype"] == "fp4"


def test_quantization_choices_are_the_loaders():
    from wideep.engine.model.build import QUANTIZATION
    [opt] = [o for o in OPTIONS if o.key == "model.quantization"]
    assert opt.spec["choices"] == list(QUANTIZATION)
    args = build_parser().parse_args(["generate", "m", "--quantization", "none"])
    assert resolve(args, "generate")["model"]["quantization"] == "none"


def test_speculative_config_help_names_every_method_and_key():
    import dataclasses

    from wideep.engine.spec_decode.config import METHODS, SpeculativeConfig
    [opt] = [o for o in OPTIONS if o.key == "speculative.*"]
    for name in (*METHODS, *(f.name for f in dataclasses.fields(SpeculativeConfig))):
        assert name in opt.help, name


def test_engine_section_keys_are_engine_options():
    """[engine] is passed to the engine as keywords: a key EngineConfig does not have would fail only at serve time."""
    import inspect

    import dataclasses

    from wideep.engine.engine_config import EngineConfig
    assert run_config.SECTIONS["engine"] <= {f.name for f in dataclasses.fields(EngineConfig)}


def test_serve_flags_without_config():
    a = _parse("serve", "/m", "--port", "0", "--dtype", "bfloat16", "--dp-size", "2", "--ep-size", "2",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-model-len", "256",
               "--block-size", "32", "--no-enable-prefix-caching", "--enable-eplb", "--enable-dbo", "auto",
               "--api-key", "k", "--max-logprobs", "5", "--seed", "7", "--host", "0.0.0.0", "--protect-metrics")
    cfg = resolve(a, SERVE, env={})
    assert cfg["model"] == {"path": "/m", "dtype": "bfloat16", "max_model_len": 256}
    assert cfg["server"] == {"port": 0, "api_key": "k", "host": "0.0.0.0", "protect_metrics": True}
    kw = run_config.llm_kwargs(cfg)
    assert kw["parallel"] == {"dp_size": 2, "ep_size": 2}
    assert {k: kw[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
                               "max_logprobs", "seed")} == {
        "max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 32, "enable_prefix_caching": False,
        "max_logprobs": 5, "seed": 7}
    assert kw["eplb"] == {"enabled": True} and kw["dbo"] == {"enabled": "auto"}
    assert resolve(_parse("serve", "/m", "--enable-dbo"), SERVE, env={})["dbo"] == {"enabled": True}
    assert "dbo" not in resolve(_parse("serve", "/m"), SERVE, env={})


def test_flags_override_config_file(tmp_path):
    path = _cfg_file(tmp_path)
    cfg = resolve(_parse("serve", "--config", path), SERVE, env={})
    assert cfg["model"]["path"] == "/from-file" and cfg["server"]["model_name"] == "file-name"
    cfg = resolve(_parse("serve", "/flag", "--config", path, "--no-enable-prefix-caching", "--max-logprobs", "3",
                         "--port", "0", "--model-name", "x"), SERVE, env={})
    assert cfg["model"] == {"path": "/flag", "dtype": "float32"}
    assert cfg["engine"] == {"enable_prefix_caching": False, "max_logprobs": 3, "block_size": 16}
    assert cfg["server"]["port"] == 0 and cfg["server"]["model_name"] == ["x"]
    # a file without [model] path serves whatever model the command line names
    no_path = _cfg_file(tmp_path, "[engine]\nmax_logprobs = 2\n")
    assert resolve(_parse("serve", "/m", "--config", no_path), SERVE, env={})["model"]["path"] == "/m"


def test_api_key_flag_beats_env_beats_file(tmp_path):
    path = _cfg_file(tmp_path)
    key = lambda *argv, env: resolve(_parse("serve", "--config", path, *argv), SERVE, env=env)["server"]["api_key"]
    assert key(env={}) == "file-key"
    assert key(env={"WIDEEP_API_KEY": "env-key"}) == "env-key"
    assert key("--api-key", "flag-key", env={"WIDEEP_API_KEY": "env-key"}) == "flag-key"
    with pytest.raises(ValueError, match="WIDEEP_API_KEY is set but empty"):
        key(env={"WIDEEP_API_KEY": ""})
    with pytest.raises(ValueError, match=r"\[server\] api_key must be a non-empty string, got a str"):
        key("--api-key", "", env={})


@pytest.mark.parametrize("argv,match", [
    (["serve"], r"no model: `wideep serve MODEL_DIR` \(or --model, or \[model\] path in --config\)"),
    (["run", "--prompt-ids", "1,2"], "no model: `wideep run MODEL_DIR`"),
    (["serve", "/a", "--model", "/b"], "two models given: MODEL_DIR '/a' and --model '/b'"),
    (["serve", "/m", "--port", "70000"], r"\[server\] port must be an int in \[0, 65535\], got 70000"),
    (["serve", "/m", "--host", ""], r"\[server\] host must be a non-empty string"),
])
def test_bad_command_lines_name_the_problem(argv, match):
    with pytest.raises(ValueError, match=match):
        resolve(_parse(*argv), argv[0], env={})


@pytest.mark.parametrize("text,match", [
    ("[server]\napi_key = 1234\n", r"api_key must be a non-empty string, got a int"),
    ("[server]\nprotect_metrics = \"yes\"\n", "protect_metrics must be true or false, got 'yes'"),
    ("[server]\nport = -1\n", r"port must be an int in \[0, 65535\], got -1"),
    ("[server]\nmodel_name = 3\n", "model_name must be a non-empty string, got 3"),
    ("[server]\nmodel_name = []\n", r"model_name must be a non-empty list of non-empty strings, got \[\]"),
    ("[server]\nmodel_name = [\"a\", 2]\n", "model_name must be a non-empty list of non-empty strings"),
    ("[server]\nallowed_origins = \"*\"\n", r"allowed_origins must be a list of strings, got '\*'"),
    ("[server]\nallowed_origins = [\"\"]\n", "allowed_origins must be a non-empty list of non-empty strings"),
])
def test_bad_server_section(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        resolve(_parse("serve", "/m", "--config", _cfg_file(tmp_path, text)), SERVE, env={})


@pytest.mark.parametrize("argv", [["serve", "/m", "--enable-dbo", "sometimes"], ["run", "/m", "--prompt-ids", "1,x"],
                                  ["serve", "/m", "--port", "eighty"], ["generate", "/m", "--prompt-ids", ","],
                                  ["serve", "/m", "--allowed-origins", "[1]"],
                                  ["serve", "/m", "--allowed-origins", ","],
                                  ["serve", "/m", "--allowed-origins", "[oops"],
                                  ["serve", "/m", "--served-model-name"],
                                  ["serve", "/m", "--kv-cache-dtype", "nvfp4"]])
def test_bad_flag_values_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2 and "error: argument" in capsys.readouterr().err


def test_run_needs_prompts(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "/m"])
    assert e.value.code == 2
    assert "nothing to run: give --prompt-ids / --prompt" in capsys.readouterr().err


def test_generate_and_run_take_the_model_positionally(tmp_path, capsys):
    d = make_tiny_checkpoint(str(tmp_path / "m"), arch="v3", seed=4)
    want = LLM(d, progress=False).generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=0.0, max_tokens=4))
    want = [o.outputs[0].token_ids for o in want]
    main(["generate", d, "--prompt-ids", "5,6,7", "--max-tokens", "4", "--quiet"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == want[0]
    main(["generate", "--model", d, "--prompt-ids", "5,6,7", "--max-tokens", "4", "--quiet"])  # the old spelling
    assert json.loads(capsys.readouterr().out)["token_ids"] == want[0]
    main(["run", d, "--prompt-ids", "5,6,7", "--prompt-ids", "9,10", "--max-tokens", "4", "--block-size", "16"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"index"')]
    assert [r["token_ids"] for r in rows] == want



def test_served_model_names_and_allowed_origins():
    """vLLM's spellings: several names after --served-model-name; origins as a JSON list or comma-separated."""
    cfg = resolve(_parse("serve", "/m", "--served-model-name", "a", "b", "--allowed-origins",
                         '["https://x.example", "*"]'), SERVE, env={})
    assert cfg["server"]["model_name"] == ["a", "b"]
    assert cfg["server"]["allowed_origins"] == ["https://x.example", "*"]
    cfg = resolve(_parse("serve", "/m", "--allowed-origins", "https://x.example, https://y.example"), SERVE, env={})
    assert cfg["server"]["allowed_origins"] == ["https://x.example", "https://y.example"]
    assert "allowed_origins" not in resolve(_parse("serve", "/m"), SERVE, env={}).get("server", {})


def test_serve_on_cpu_defaults_the_prefill_budget_to_2048():
    """launch/cli/serve.py serving_defaults: serve's CPU budget where the run config is silent; an explicit one, a
    CUDA device and prefill/decode pools keep theirs (the library's default stays EngineConfig's 8192)."""
    from wideep.engine.engine_config import EngineConfig
    from wideep.launch.cli.serve import SERVE_CPU_MAX_NUM_BATCHED_TOKENS, serving_defaults
    kw = run_config.llm_kwargs(resolve(_parse("serve", "/m"), SERVE, env={}))
    assert "max_num_batched_tokens" not in kw
    assert serving_defaults(dict(kw, device="cpu"))["max_num_batched_tokens"] == SERVE_CPU_MAX_NUM_BATCHED_TOKENS == 2048
    given = run_config.llm_kwargs(resolve(_parse("serve", "/m", "--max-num-batched-tokens", "512"), SERVE, env={}))
    assert serving_defaults(dict(given, device="cpu"))["max_num_batched_tokens"] == 512
    assert "max_num_batched_tokens" not in serving_defaults(dict(kw, device="cuda"))
    assert "max_num_batched_tokens" not in serving_defaults(dict(kw, device="cpu", disagg={"prefill": {}}))
    assert EngineConfig.from_options("/m").max_num_batched_tokens == 8192
