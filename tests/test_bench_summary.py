"""The README's benchmark table is generated from bench/results/*.json (bench/summary.py).

Fixture results in a tmp dir: the rows read their fields, decide met / not met, and say "not run"
for a benchmark without a file; --check fails on a table that differs. Last, the committed README
against the committed results. No benchmark runs here.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import summary
from bench.results import META, save

REPO = Path(__file__).resolve().parents[1]

DECODE = {"threads": [1, 2], "trials": 3, "ratio": 5.4, "wideep_tok_s": 348.9, "hf_tok_s": 64.5,
          "decode_roofline_fraction": 0.72, "decode_roofline_fraction_cpu_time": 0.8,
          "wideep_prefix_cache_hit_tokens": 0,
          "roofline": {"1t": {"decode_step_ms": 33.3, "decode_gbs": 18.0, "fraction": 0.72, "ceiling_gbs": 25.0,
                              "ceiling": "read_huge"},
                       "2t": {"decode_step_ms": 33.1, "decode_gbs": 18.1, "fraction": 0.55, "ceiling_gbs": 33.0,
                              "ceiling": "read_huge"}}}
DISAGG = {"tpot_p99_ratio": 0.3, "workload": {"long_prompts": 36}, "disagg_goodput_rps": 2.0,
          "colocated_goodput_rps": 1.5}


def _write(d: Path, name: str, result: dict, commit: str = "abc1234", command: str = "", machine=None) -> None:
    d.mkdir(exist_ok=True)
    command = command or f"python bench/{name}.py"
    machine = machine or {"nproc": 2, "cpu_model": "Test(R) CPU", "isa": ["avx2", "fma"],
                          "load_avg_1_5_15m": [1.5, 1.0, 0.5]}
    (d / f"{name}.json").write_text(json.dumps(dict(result, commit=commit, command=command,
                                                    date="2026-12-01T00:00:00Z", machine=machine)))


def _row(results: Path, label: str) -> list[str]:
    line = next(x for x in summary.table(results).splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_no_results_file_gives_a_not_run_row(tmp_path):
    block = summary.table(tmp_path / "none")
    rows = [x for x in block.splitlines() if x.startswith("| ") and not x.startswith("| benchmark")]
    assert len(rows) == len(summary.ROWS)
    assert all(summary.NOT_RUN in r and r.endswith("| — | — |") for r in rows)
    assert "met" not in block


def test_decode_row_is_formatted_from_the_fields_and_judged_against_the_target(tmp_path):
    _write(tmp_path, "decode_vs_hf", DECODE)
    _, command, result, target, cpu, commit = _row(tmp_path, "decode vs transformers")
    assert command == "`python bench/decode_vs_hf.py`" and commit == "abc1234" and cpu == "Test CPU (AVX2)"
    assert "5.4× transformers" in result and "**0.72** of the best read ceiling (25 GB/s, `read_huge`)" in result
    assert "0.55 of 33 GB/s at 2 (in CPU time: 0.8)" in result and "prefix-cache hit tokens 0" in result
    assert target.endswith("(met)")
    _write(tmp_path, "decode_vs_hf", dict(DECODE, decode_roofline_fraction=0.65))
    assert _row(tmp_path, "decode vs transformers")[3].endswith("(not met / met)")
    _write(tmp_path, "decode_vs_hf", dict(DECODE, wideep_prefix_cache_hit_tokens=1024))
    assert _row(tmp_path, "decode vs transformers")[3].endswith("(met / not met)")


def test_a_target_of_several_parts_is_judged_part_by_part(tmp_path):
    _write(tmp_path, "host_overhead", {"host_ms_per_step": {"256": 5.5}, "rounds": {"256": [5.1, 5.5, 6.0]},
                                       "ratio_1024_vs_256": 3.5})
    _, _, result, target, _, _ = _row(tmp_path, "host overhead per decode step")
    assert result.startswith("5.5 ms at batch 256 (rounds 5.1, 5.5, 6)")
    assert target == "≤ 5 ms / ≤ 5 ms with processing / 1024 ÷ 256 ≤ 4.5 (not met / not met / met)"
    _write(tmp_path, "host_overhead", {"host_ms_per_step": {"256": 4.5, "256+processing": 4.9},
                                       "rounds": {"256": [4.5], "256+processing": [4.9, 5.2]}, "ratio_1024_vs_256": 3.5})
    _, _, result, target, _, _ = _row(tmp_path, "host overhead per decode step")
    assert result.endswith("on every request 4.9 ms (rounds 4.9, 5.2)")
    assert target == "≤ 5 ms / ≤ 5 ms with processing / 1024 ÷ 256 ≤ 4.5 (met)"


def test_disaggregation_row_shows_the_default_run_beside_quick(tmp_path):
    _write(tmp_path, "disagg_quick", DISAGG, command="python bench/disagg.py --quick")
    _, command, result, target, _, _ = _row(tmp_path, "prefill/decode disaggregation")
    assert command == "`python bench/disagg.py` / `python bench/disagg.py --quick`"
    assert result.startswith(f"default: {summary.NOT_RUN}; `--quick`: TPOT p99 0.3× of colocated")
    assert target == "≤ 0.5× (default: not run; `--quick`: met)"
    _write(tmp_path, "disagg", dict(DISAGG, tpot_p99_ratio=0.6), commit="def5678")
    _, _, result, target, _, commit = _row(tmp_path, "prefill/decode disaggregation")
    assert result.startswith("default: TPOT p99 0.6×") and target == "≤ 0.5× (default: not met; `--quick`: met)"
    assert commit == "def5678 / abc1234"


def test_a_file_without_the_rows_fields_says_so(tmp_path):
    _write(tmp_path, "dsa", {"time": "cpu"})
    _, _, result, target, _, _ = _row(tmp_path, "DeepSeek Sparse Attention")
    assert "lacks" in result and "dsa_vs_dense_attention_8k" in result and target == "≤ 0.5"


def test_check_fails_on_a_stale_table_and_passes_after_the_rewrite(tmp_path):
    results = tmp_path / "results"
    _write(results, "dsa", {"time": "cpu", "dsa_vs_dense_attention_8k": 0.4})
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{summary.START}\n| old | figure |\n{summary.END}\n\nafter\n")
    args = ["--results", str(results), "--readme", str(readme)]
    assert summary.main([*args, "--check"]) == 1
    assert summary.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "| old |" not in text
    assert "0.4× dense MLA's decode attention cpu time at 8k context | ≤ 0.5 (met) | Test CPU (AVX2) | abc1234 |" in text
    assert summary.main([*args, "--check"]) == 0


def test_save_adds_the_run_conditions(tmp_path):
    path = save("x", {"a": 1}, directory=tmp_path)
    rec = json.loads(path.read_text())
    assert rec["a"] == 1 and set(META) <= set(rec)
    assert rec["machine"]["nproc"] >= 1 and rec["command"].startswith("python ")
    with pytest.raises(ValueError, match="commit"):
        save("y", {"commit": "mine"}, directory=tmp_path)


def test_the_committed_readme_matches_the_committed_results():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "summary.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]


def test_the_commit_is_dirty_for_code_changes_not_for_results(tmp_path):
    """A series of benchmarks rewrites bench/results/ as it runs: the later runs' code is still the commit's."""
    from bench.results import commit

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "a.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    assert not commit(tmp_path).endswith("-dirty")
    (tmp_path / "bench" / "results" / "a.json").write_text('{"new": 1}')
    assert not commit(tmp_path).endswith("-dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit(tmp_path).endswith("-dirty")


def test_each_row_names_the_cpu_it_ran_on(tmp_path):
    """The CPU column: the model, its widest vector ISA, and the native kernels' build when not for that CPU."""
    _write(tmp_path, "dsa", {"dsa_vs_dense_attention_8k": 0.4},
           machine={"nproc": 2, "cpu_model": "Intel(R) Xeon(R) Processor", "isa": ["avx2", "avx512f", "amx_bf16"],
                    "kernels": {"march": "native"}})
    assert _row(tmp_path, "DeepSeek Sparse Attention")[4] == "Intel Xeon (AMX)"
    _write(tmp_path, "dsa", {"dsa_vs_dense_attention_8k": 0.4},
           machine={"nproc": 2, "cpu_model": "AMD EPYC 9R14", "isa": ["avx2", "avx512f"],
                    "kernels": {"march": "x86-64-v3"}})
    assert _row(tmp_path, "DeepSeek Sparse Attention")[4] == "AMD EPYC 9R14 (AVX-512), kernels for x86-64-v3"
    _write(tmp_path, "dsa", {"dsa_vs_dense_attention_8k": 0.4}, machine={"nproc": 2, "cpu_model": "Old"})
    assert _row(tmp_path, "DeepSeek Sparse Attention")[4] == "Old"   # a file from before the ISA was recorded


def test_a_run_is_recorded_only_when_asked(tmp_path):
    """Without --record (or WIDEEP_BENCH_RECORD=1) a benchmark's file goes to the scratch directory; with it, to
    bench/results; --record is taken out of the arguments the benchmark parses."""
    import os
    import subprocess
    import sys
    code = ("import sys; from bench import results; print(results.RECORD, sys.argv[1:], "
            "results.save('t', {'a': 1}).parent)")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("WIDEEP_BENCH_RECORD",)}
    env["WIDEEP_BENCH_DIR"] = str(tmp_path / "scratch")
    r = subprocess.run([sys.executable, "-c", code, "--x"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "['--x']", str(tmp_path / "scratch")]
    assert (tmp_path / "scratch" / "t.json").exists()
    probe = ("import sys; from bench import results; print(results.RECORD, sys.argv[1:], results.RESULTS)")
    r = subprocess.run([sys.executable, "-c", probe, "--record", "--x"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.split() == ["True", "['--x']", str(root / "bench" / "results")], r.stderr
    r = subprocess.run([sys.executable, "-c", probe], cwd=root, env=dict(env, WIDEEP_BENCH_RECORD="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split()[0] == "True", r.stderr
