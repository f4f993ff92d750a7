"""What `pip install` puts on a user's machine is exactly the project's packages, with the CPU kernels' C.

Builds the wheel (the same build a `pip install .` runs) and compares its contents with the
repository: every top-level package (a folder with __init__.py, other than tests/ and bench/) and
every module in it must be in the wheel, and nothing else may be. A package missing from the
wheel works from the repository root and fails for every user who installed it (disagg once did).
The wheel, unpacked alone outside the checkout, builds the CPU kernels from its own C and runs them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_INSTALLED = {"tests", "bench", "docs", "build"}


def _repo_modules() -> set[str]:
    out = set()
    for init in REPO.glob("*/__init__.py"):
        pkg = init.parent
        if pkg.name in NOT_INSTALLED or pkg.name.startswith("."):
            continue
        for f in pkg.rglob("*.py"):
            if "__pycache__" not in f.parts:
                out.add(f.relative_to(REPO).as_posix())
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy: setuptools keeps build/lib between builds, and a stale copy of a package there
    # would hide that the configuration no longer includes it.
    src = tmp_path_factory.mktemp("src") / "wideep"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".venv"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named 'setuptools'" in r.stderr + r.stdout:
        cmd.remove("--no-build-isolation")  # a Python without setuptools: let pip fetch the build backend
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("wideep-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_holds_exactly_the_project_packages(wheel):
    in_wheel = {n for n in wheel.namelist() if n.endswith(".py")}
    repo = _repo_modules()
    assert repo - in_wheel == set(), f"modules missing from the wheel: {sorted(repo - in_wheel)}"
    assert in_wheel - repo == set(), f"files in the wheel that are not project modules: {sorted(in_wheel - repo)}"
    top = {n.split("/")[0] for n in in_wheel}
    assert {"wideep", "engine", "disagg", "launch", "parallel", "moe", "attention_mla", "eplb", "dbo"} <= top


def test_wheel_holds_the_c_sources(wheel):
    csrc = {f"cpu/csrc/{p.name}" for p in (REPO / "cpu" / "csrc").iterdir() if p.suffix in (".c", ".h")}
    assert "cpu/csrc/wideep.h" in csrc and csrc - set(wheel.namelist()) == set()


INSTALLED_KERNELS = """
import os, sys, torch
import torch.nn.functional as F
root, repo = sys.argv[1], sys.argv[2]
import cpu
from cpu import build, gemm, layers
assert build.unusable() is None, build.unusable()
assert cpu.__file__.startswith(root) and build.CSRC.startswith(root), (cpu.__file__, build.CSRC)
from_repo = [m.__file__ for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(repo)]
assert not from_repo, from_repo
x, w = torch.randn(3, 37), torch.randn(19, 37)
torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
torch.testing.assert_close(layers.rmsnorm(x, w[0], 1e-6), w[0] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
print("built", sorted(os.listdir(os.environ["WIDEEP_CACHE_DIR"])))
"""


def test_the_unpacked_wheel_builds_and_runs_the_kernels(wheel, tmp_path):
    """The wheel's files alone first on the path, run outside the checkout with an empty kernel cache:
    the library is built from the C the wheel carries (package data), not from the repository's."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    root, cache = tmp_path / "site", tmp_path / "cache"
    wheel.extractall(root)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WIDEEP_CPU_SANITIZE", "LD_PRELOAD")}
    env |= {"PYTHONPATH": str(root), "WIDEEP_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, "-c", INSTALLED_KERNELS, str(root), str(REPO)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wideep_cpu-" in r.stdout


def test_wheel_declares_the_cli(wheel):
    (entry,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(entry).decode()
    assert "wideep = launch.cli:main" in text


def test_wideep_reexports_the_public_api():
    import engine
    import wideep
    for name in ("Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput"):
        assert getattr(wideep, name) is getattr(engine, name)
    assert issubclass(wideep.LLM, engine.LLM)   # plus disagg=, which the engine package cannot build
    assert isinstance(wideep.__version__, str) and wideep.__version__
