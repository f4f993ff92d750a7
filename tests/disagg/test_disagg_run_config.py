"""A TOML run config with a [disagg] section: bad sections fail with the section named; `wideep run`
on 2 prefill + 2 decode local ranks prints the same tokens as one process with the same file."""
from __future__ import annotations

import json

import pytest

from wideep.launch.cli import run_config
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.runs import outputs, run_single_and_ranks

BASE = """
[model]
path = "{path}"

[parallel]
timeout_s = 60

[engine]
block_size = 16

[run]
prompt_ids = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17],
              [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
max_tokens = 6
"""
DISAGG = """
[disagg]
kv_transfer = "torch"

[disagg.prefill]
dp_size = 2
ep_size = 2
max_num_batched_tokens = 8

[disagg.decode]
dp_size = 2
ep_size = 2
max_num_seqs = 3
kv_cache_blocks = 6
"""


@pytest.mark.parametrize("text,match", [
    ("[disagg]\nprefil = 1\n", r"unknown keys \['prefil'\] in \[disagg\]"),
    ("[disagg.decode]\ndp_size = 2\nep_size = 1\n",
     r"\[disagg\] disagg.decode.ep_size \(1\) != disagg.decode.dp_size \(2\)"),
    ("[disagg.prefill]\nkv_blocks = 2\n", r"unknown disagg.prefill keys \['kv_blocks'\]"),
])
def test_bad_disagg_sections(tmp_path, text, match):
    p = tmp_path / "x.toml"
    p.write_text("[model]\npath='x'\n" + text)
    with pytest.raises(ValueError, match=match):
        run_config.load(str(p))


@pytest.mark.multirank
def test_wideep_run_disaggregated_equals_single_process(tmp_path, capfd):
    d = make_tiny_checkpoint(str(tmp_path / "m"), arch="v3", seed=4)
    single_cfg, disagg_cfg = tmp_path / "single.toml", tmp_path / "disagg.toml"
    single_cfg.write_text(BASE.format(path=d))
    disagg_cfg.write_text(BASE.format(path=d) + DISAGG)
    single, multi = run_single_and_ranks(["run", "--config", str(single_cfg)], ["run", "--config", str(disagg_cfg)],
                                         4, capfd)
    assert outputs(multi) == outputs(single) and len(outputs(multi)) == 4
    summary = json.loads([line for line in multi.splitlines() if line.startswith('{"ranks"')][0])
    # the front sits in the decode pool: every output token was produced on decode ranks 0 and 1
    assert summary["ranks"] == 4 and sum(summary["per_rank_tokens"][:2]) == 24 == sum(summary["per_rank_tokens"])
