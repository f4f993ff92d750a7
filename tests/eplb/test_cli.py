"""`wideep eplb-plan` / `eplb-report` from a stats file, and a planned placement used at start-up
(eplb.initial_placement): same outputs, each slot holding its expert's checkpoint weights."""
from __future__ import annotations

import json
import re

import pytest
import torch

from wideep.eplb import EplbConfig
from wideep.launch.cli.main import main
from tests.eplb.helpers import build_llm, experts_match_checkpoint, generate, make_skewed_checkpoint, max_diff


def _stats(path, ep=4, redundant=4):
    g = torch.Generator().manual_seed(0)
    load = (torch.exp(torch.randn(3, 16, generator=g) * 1.5) * 100).long()
    stats = {"load": load.tolist(), "phy2log": [[p % 16 for p in range(16 + redundant)]] * 3, "ep_size": ep,
             "num_groups": 4}
    path.write_text(json.dumps(stats))
    return str(path)


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eplb_plan_improves_balance_and_writes_a_placement(tmp_path, capsys):
    stats, out = _stats(tmp_path / "stats.json"), str(tmp_path / "placement.json")
    main(["eplb-plan", "--load", stats, "--out", out])
    s = _last_json(capsys)
    assert s["physical"] == 20 and s["ep_size"] == 4 and s["before"] == "stats phy2log"
    assert min(s["balancedness_after"]) > max(s["balancedness_before"])
    assert len(json.load(open(out))["phy2log"]) == 3
    main(["eplb-plan", "--load", stats, "--from-scratch", "--ep-size", "2", "--num-redundant-experts", "0"])
    s = _last_json(capsys)
    assert s["physical"] == 16 and s["ep_size"] == 2 and s["before"].startswith("initial")


@pytest.mark.parametrize("content,match", [
    ("{}", 'need a "load" key'), ("[1, 2", "not valid JSON"), ('{"load": [1, 2]}', r"got shape \[2\]")])
def test_eplb_plan_bad_stats(tmp_path, capsys, content, match):
    (tmp_path / "s.json").write_text(content)
    with pytest.raises(SystemExit):
        main(["eplb-plan", "--load", str(tmp_path / "s.json")])
    assert re.search(match, capsys.readouterr().err)


def test_eplb_plan_ranks_must_divide_slots(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eplb-plan", "--load", _stats(tmp_path / "s.json"), "--ep-size", "3"])
    assert "experts + redundant slots (16 + 4 = 20) is not divisible by ep_size (3)" in capsys.readouterr().err


def test_eplb_report_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "report.png")
    main(["eplb-report", "--load", _stats(tmp_path / "s.json"), "--out", out])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_initial_placement_file_at_startup(tmp_path, capsys):
    from wideep.engine import LLM
    from wideep.engine.model.families import load_model
    d = make_skewed_checkpoint(str(tmp_path / "m"))
    ref = generate(LLM(d, progress=False))
    out = str(tmp_path / "placement.json")
    main(["eplb-plan", "--load", _stats(tmp_path / "s.json", ep=1, redundant=3), "--out", out])
    model = load_model(d, progress=False, eplb={"initial_placement": out, "num_redundant_experts": 3})
    assert model.placement.phy2log.tolist() == json.load(open(out))["phy2log"]
    assert experts_match_checkpoint(model, d) == []
    llm, _ = build_llm(d, EplbConfig(initial_placement=out, num_redundant_experts=3))
    got = generate(llm)
    assert max_diff(got[0], ref[0]) <= 1e-5 and got[1] == ref[1]
