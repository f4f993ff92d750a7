"""What `pip install` puts on a user's machine is exactly the project's packages.

Builds the wheel (the same build a `pip install .` runs) and compares its contents with the
repository: every top-level package (a folder with __init__.py, other than tests/ and bench/) and
every module in it must be in the wheel, and nothing else may be. A package missing from the
wheel works from the repository root and fails for every user who installed it (disagg once did).
"""
from __future__ import annotations

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
