"""bench/gpu_check.sh --smoke: the GPU check's every code path on CPU (tiny shapes, interpreted Triton),
so the script that only runs on a GPU cannot rot unnoticed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    # the script runs `python`: make that this interpreter (a venv's, with its own Triton), not PATH's first
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--smoke", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["smoke"] is True and res["device"] == "cpu"
    assert res["ceilings"]["matmul_tflops"] > 0 and res["ceilings"]["copy_gbps"] > 0
    paths = {(r["path"], r["tokens"]) for r in res["moe"]}
    assert {("triton_bf16", 8), ("triton_bf16", 24), ("triton_fp8", 8), ("triton_fp8", 24),
            ("triton_bf16_sweep", 24)} <= paths
    checked = [r for r in res["moe"] if "rel_err_vs_torch" in r]
    assert checked and all(r["rel_err_vs_torch"] < 0.05 for r in checked)
    assert all(r["tflops"] > 0 and 0 < r["fraction_of_peak"] for r in res["moe"])
    assert {r["batch"] for r in res["mla_decode"]} == {2, 3}
    assert all(r["rel_err_vs_torch"] < 0.02 and r["gbps"] > 0 for r in res["mla_decode"])
    assert sum(r["best"] for r in res["mla_decode"]) == 2
    assert set(res["targets"]) == {"fraction", "moe_large", "mla_large", "moe_large_best_sweep_fraction"}
    assert res["complete"] is True and res["errors"] == []
