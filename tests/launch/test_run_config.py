"""Run-config files: validation, CLI overrides, and one file serving 1 and 2 ranks (the latter with
--enable-dbo) identically."""
from __future__ import annotations

import json

import pytest

from wideep.launch.cli import run_config
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.runs import outputs, run_single_and_ranks

CONFIG = """
[model]
path = "{path}"
dtype = "float32"

[parallel]
dispatch_backend = "torch"
timeout_s = 60

[engine]
block_size = 16

[run]
prompt_ids = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
max_tokens = 6
"""


def _write(tmp_path, text: str) -> str:
    p = tmp_path / "x.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text,match", [
    ("[model]\npath='x'\n[bogus]\na=1\n", r"unknown section \[bogus\]"),
    ("[model]\npath='x'\n[parallel]\nep=4\n", r"unknown keys \['ep'\] in \[parallel\]"),
    ("[parallel]\nep_size=2\n", r"\[model\] path is required"),
    ("[model]\npath='x'\n[dbo]\nenabled='sometimes'\n", r"\[dbo\] dbo.enabled must be"),
    ("[model\npath='x'\n", "not valid TOML"),
])
def test_bad_run_configs(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        run_config.load(_write(tmp_path, text))


def test_flags_override_file(tmp_path):
    cfg = run_config.load(_write(tmp_path, CONFIG.format(path="/m")))
    cfg = run_config.override(cfg, parallel__ep_size=4, model__dtype=None)
    kw = run_config.llm_kwargs(cfg)
    assert kw["parallel"] == {"dispatch_backend": "torch", "timeout_s": 60, "ep_size": 4}
    assert kw["dtype"] == "float32" and kw["block_size"] == 16
    cfg = run_config.override(cfg, dbo__enabled="auto", eplb__enabled=True)
    kw = run_config.llm_kwargs(cfg)
    assert kw["dbo"] == {"enabled": "auto"} and kw["eplb"] == {"enabled": True}


@pytest.mark.multirank
def test_same_config_single_process_and_two_ranks(tmp_path, capfd):
    d = make_tiny_checkpoint(str(tmp_path / "m"), arch="v3", seed=4)
    path = _write(tmp_path, CONFIG.format(path=d))
    single, multi = run_single_and_ranks(["run", "--config", path], ["run", "--config", path, "--enable-dbo"], 2,
                                         capfd)
    assert outputs(multi) == outputs(single) and len(outputs(multi)) == 3
    summary = json.loads([line for line in multi.splitlines() if line.startswith('{"ranks"')][0])
    assert summary["ranks"] == 2 and sum(summary["per_rank_tokens"]) == 18
    assert summary["expert_bytes_per_rank"][0] == summary["expert_bytes_per_rank"][1] > 0


def test_backend_keys_validated_and_passed_to_llm():
    cfg = run_config.validate({"model": {"path": "m", "experts_backend": "triton", "attention_backend": "torch"}})
    kw = run_config.llm_kwargs(cfg)
    assert kw["experts_backend"] == "triton" and kw["attention_backend"] == "torch"
    assert "experts_backend" not in run_config.llm_kwargs(run_config.validate({"model": {"path": "m"}}))
    with pytest.raises(ValueError, match=r"experts_backend must be one of .*got 'cutlass'"):
        run_config.validate({"model": {"path": "m", "experts_backend": "cutlass"}})
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*got 'flashmla'"):
        run_config.validate({"model": {"path": "m", "attention_backend": "flashmla"}})
