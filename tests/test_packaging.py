"""What `pip install` puts on a user's machine is exactly the project's packages, under one name, with the
CPU kernels' C.

Builds the wheel (the same build a `pip install .` runs) and compares its contents with the
repository: every top-level package (a folder with __init__.py, other than tests/ and bench/) and
every module in it must be in the wheel as `wideep/<folder>/...`, and nothing else may be; the wheel's
only top-level names are `wideep` and its dist-info. A package missing from the wheel works from the
repository root and fails for every user who installed it (disagg once did). The wheel, unpacked alone
outside the checkout, builds the CPU kernels from its own C and runs them. A working directory with its
own `engine/`, `layers/`, `launch/` and `cpu/` packages does not shadow wideep's.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_INSTALLED = {"tests", "bench", "docs", "build"}
# the layout's folders, each installed as wideep.<folder>
LAYOUT = sorted(p.parent.name for p in REPO.glob("*/__init__.py")
                if p.parent.name not in NOT_INSTALLED | {"wideep"} and not p.parent.name.startswith("."))


def _repo_modules() -> set[str]:
    out = set()
    for init in REPO.glob("*/__init__.py"):
        pkg = init.parent
        if pkg.name in NOT_INSTALLED or pkg.name.startswith("."):
            continue
        for f in pkg.rglob("*.py"):
            if "__pycache__" not in f.parts:
                rel = f.relative_to(REPO).as_posix()
                out.add(rel if pkg.name == "wideep" else f"wideep/{rel}")
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
    assert {"engine", "disagg", "launch", "parallel", "moe", "attention_mla", "eplb", "dbo", "cpu"} <= set(LAYOUT)
    top = {n.split("/")[0] for n in wheel.namelist()}
    (dist_info,) = top - {"wideep"}
    assert dist_info.startswith("wideep-") and dist_info.endswith(".dist-info"), top


def test_wheel_holds_the_c_sources(wheel):
    csrc = {f"wideep/cpu/csrc/{p.name}" for p in (REPO / "cpu" / "csrc").iterdir() if p.suffix in (".c", ".h")}
    assert "wideep/cpu/csrc/wideep.h" in csrc and csrc - set(wheel.namelist()) == set()


INSTALLED_KERNELS = """
import os, sys, torch
import torch.nn.functional as F
root, repo = sys.argv[1], sys.argv[2]
import wideep.cpu as cpu
from wideep.cpu import build, gemm, layers
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
    assert "wideep = wideep.launch.cli.main:main" in text


def test_wideep_reexports_the_public_api():
    import wideep
    import wideep.engine as engine
    for name in ("Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "CompletionOutput"):
        assert getattr(wideep, name) is getattr(engine, name)
    assert issubclass(wideep.LLM, engine.LLM)   # plus disagg=, which the engine package cannot build
    assert isinstance(wideep.__version__, str) and wideep.__version__


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_no_module_imports_a_layout_folder_by_its_bare_name():
    """`from engine import ...` works from the repository root (the folder is on the path) and nowhere
    else, and it would load a second copy of the module beside wideep.engine's: every import names
    wideep.<folder>, in the packages, the tests and the benchmarks alike (code in strings included,
    where it is a whole module run by `python -c`)."""
    bad = []
    for f in REPO.rglob("*.py"):
        if {".git", "build", "__pycache__"} & set(f.parts) or ".venv" in f.parts:
            continue
        src = f.read_text()
        trees = [ast.parse(src)]
        for node in ast.walk(trees[0]):  # code passed to `python -c`
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
                try:
                    trees.append(ast.parse(node.value))
                except SyntaxError:
                    pass
        for tree in trees:
            bad += [f"{f.relative_to(REPO)}:{line}: {name}" for line, name in _imported_names(tree)
                    if name.split(".")[0] in LAYOUT]
    assert not bad, "imports of a layout folder by its bare name (write wideep.<folder>):\n" + "\n".join(bad)


FOREIGN_RUN = """
import importlib, sys
engine, layers, launch, cpu = map(importlib.import_module, ("engine", "layers", "launch", "cpu"))  # this directory's
assert all(m.MINE for m in (engine, layers, launch, cpu))
from wideep import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
make_tiny_checkpoint(sys.argv[1])
out = LLM(sys.argv[1]).generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
assert len(out[0].outputs[0].token_ids) == 4, out
assert all(m.MINE for m in (engine, layers, launch, cpu))
ours = sorted(n for n, m in sys.modules.items() if n.split(".")[0] in {"engine", "layers", "launch", "cpu"}
              and not (getattr(m, "__file__", "") or "").startswith(sys.argv[2]))
assert not ours, ours
print("ok", out[0].outputs[0].token_ids)
"""


def test_a_working_directory_with_its_own_engine_and_launch_does_not_shadow_wideep(tmp_path):
    """A serving stack that embeds wideep has its own `engine/`, `layers/`, `launch/` and `cpu/` on its path:
    its imports get its own packages, wideep's get wideep's, and `python -m wideep.launch` works there."""
    app = tmp_path / "app"
    for name in ("engine", "layers", "launch", "cpu"):
        (app / name).mkdir(parents=True)
        (app / name / "__init__.py").write_text("MINE = True\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WIDEEP_CPU_SANITIZE", "LD_PRELOAD")}
    env["PYTHONPATH"] = str(app)
    r = subprocess.run([sys.executable, "-c", FOREIGN_RUN, str(tmp_path / "ckpt"), str(app)], cwd=app, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "wideep.launch", "--help"], cwd=app, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "make-tiny" in r.stdout, r.stdout + r.stderr
