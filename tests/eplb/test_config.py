"""EPLB configuration: EplbConfig and the run config's [eplb] section fail early with the numbers."""
from __future__ import annotations

import pytest

from wideep.eplb import EplbConfig
from wideep.launch.cli import run_config


@pytest.mark.parametrize("kwargs,match", [
    ({"num_redundant_experts": -2}, r"eplb.num_redundant_experts must be an integer >= 0, got -2"),
    ({"window_size": 0}, r"eplb.window_size must be an integer >= 1, got 0"),
    ({"step_interval": 0}, r"eplb.step_interval must be an integer >= 1, got 0"),
    ({"step_interval": 2.5}, r"eplb.step_interval must be an integer >= 1, got 2.5"),
    ({"transfer_layers_per_step": -1}, r"transfer_layers_per_step must be an integer >= 0"),
    ({"policy": "random"}, r"eplb.policy must be one of \('auto', 'hierarchical', 'global'\), got 'random'"),
    ({"enabled": "yes"}, r"eplb.enabled must be true or false"),
])
def test_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EplbConfig(**kwargs)


def test_slots_must_divide_over_ranks():
    with pytest.raises(ValueError, match=r"n_routed_experts \+ num_redundant_experts \(16 \+ 3 = 19\) is not "
                                         r"divisible by ep_size \(4\); use a num_redundant_experts that makes it "
                                         r"a multiple of 4"):
        EplbConfig(num_redundant_experts=3).validate(4, 16)
    with pytest.raises(ValueError, match=r"n_routed_experts \+ num_redundant_experts \(16 \+ 0 = 16\) .* ep_size \(3\)"):
        EplbConfig().validate(3, 16)
    with pytest.raises(ValueError, match=r"a rank would hold two copies of one expert"):
        EplbConfig(num_redundant_experts=20).validate(2, 16)
    assert EplbConfig(num_redundant_experts=4).validate(4, 16) == 4
    assert EplbConfig(num_redundant_experts=3).validate(1, 16) == 3   # one rank: replicas side by side


def test_redundant_from_either_section():
    assert EplbConfig().validate(2, 16, parallel_redundant=2) == 2
    assert EplbConfig(num_redundant_experts=2).validate(2, 16, parallel_redundant=2) == 2
    with pytest.raises(ValueError, match=r"eplb.num_redundant_experts \(2\) != parallel.num_redundant_experts \(4\)"):
        EplbConfig(num_redundant_experts=2).validate(2, 16, parallel_redundant=4)


def test_from_dict_and_coerce():
    with pytest.raises(ValueError, match=r"unknown eplb config keys \['window'\]"):
        EplbConfig.from_dict({"window": 10})
    cfg = EplbConfig.coerce({"enabled": True, "window_size": 10})
    assert cfg.enabled and cfg.window_size == 10 and EplbConfig.coerce(cfg) is cfg
    assert EplbConfig.coerce(None) == EplbConfig() and not EplbConfig().enabled
    assert EplbConfig.from_dict(cfg.to_dict()) == cfg


def _write(tmp_path, text):
    p = tmp_path / "x.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("body,match", [
    ("window_size = 0", r"\[eplb\] eplb.window_size must be an integer >= 1, got 0"),
    ("num_redundant_experts = -1", r"\[eplb\] eplb.num_redundant_experts must be an integer >= 0, got -1"),
    ("policy = 'best'", r"\[eplb\] eplb.policy must be one of"),
    ("windows = 3", r"unknown keys \['windows'\] in \[eplb\]"),
])
def test_run_config_eplb_section_errors(tmp_path, body, match):
    with pytest.raises(ValueError, match=match):
        run_config.load(_write(tmp_path, f"[model]\npath = 'm'\n[eplb]\n{body}\n"))


def test_run_config_eplb_section_reaches_the_engine_options(tmp_path):
    text = ("[model]\npath = 'm'\n[eplb]\nenabled = true\nwindow_size = 100\nstep_interval = 50\n"
            "num_redundant_experts = 4\npolicy = 'global'\n")
    kw = run_config.llm_kwargs(run_config.load(_write(tmp_path, text)))
    assert EplbConfig.coerce(kw["eplb"]) == EplbConfig(enabled=True, window_size=100, step_interval=50,
                                                      num_redundant_experts=4, policy="global")
    assert "eplb" not in run_config.llm_kwargs(run_config.load(_write(tmp_path, "[model]\npath = 'm'\n")))
