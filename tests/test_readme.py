"""The documentation's examples run as written.

Every ```python block of README.md and docs/*.md runs in a fresh interpreter against a tiny random
checkpoint (the path /tmp/wideep-tiny the examples use is replaced by this test's own directory);
a block preceded by `<!-- readme-test: torchrun N -->` runs under `torchrun --nproc-per-node N`.
Every ```toml block loads through the real run-config loader and builds an EngineConfig, so a key the
docs show can never be one the code rejects.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TINY = "/tmp/wideep-tiny"
MARK = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")


def _blocks(lang: str) -> list[tuple[str, int, str, str]]:
    """-> (file, line, marker, code) of every ```lang block."""
    out = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            if lines[i].strip() == f"```{lang}":
                j = lines.index("```", i + 1)
                prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                m = MARK.search(prev)
                out.append((path.relative_to(REPO).as_posix(), i + 1, m.group(1) if m else "", "\n".join(lines[i + 1:j])))
                i = j
            i += 1
    return out


PYTHON = _blocks("python")
TOML = _blocks("toml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=0)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    return env


def test_the_first_install_covers_the_readmes_commands():
    """The README's first `pip install` installs the extra of every `wideep` command its examples use (a user who
    runs the first command and then the example's `wideep serve` must get a server, not an ImportError)."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    text = (REPO / "README.md").read_text()
    first = next(line for line in text.splitlines() if line.startswith("pip install"))
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for command, extra in (("wideep serve", "serve"),):
        assert extra in extras
        if command in text:
            assert re.search(rf"-e '?\.\[[^\]]*\b{extra}\b", first), f"{first!r} does not install [{extra}]"


def test_the_docs_have_examples():
    assert len(PYTHON) >= 4 and any(f == "README.md" for f, *_ in PYTHON)
    assert TOML


@pytest.mark.parametrize("where, line, marker, code", PYTHON, ids=[f"{f}:{n}" for f, n, *_ in PYTHON])
def test_python_example_runs(where, line, marker, code, tiny, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code.replace(TINY, tiny))
    if marker.startswith("torchrun"):
        nproc = int(marker.split()[1])
        torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), str(script)]
    elif marker:
        raise AssertionError(f"{where}:{line}: unknown readme-test marker {marker!r}")
    else:
        cmd = [sys.executable, str(script)]
    try:
        r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{where}:{line} did not finish in 300 s:\n{e.stdout}\n{e.stderr}") from None
    assert r.returncode == 0, f"{where}:{line} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("where, line, marker, text", TOML, ids=[f"{f}:{n}" for f, n, *_ in TOML])
def test_toml_example_loads(where, line, marker, text, tmp_path):
    from wideep.engine.engine_config import EngineConfig
    from wideep.launch.cli import run_config
    path = tmp_path / "x.toml"
    path.write_text(text)
    cfg = run_config.load(str(path), require_model=False)   # a fragment ([eplb] alone) is fine
    EngineConfig.from_sections(dict(cfg, model=dict(cfg.get("model", {}), path=cfg.get("model", {}).get("path", "/m"))),
                               world_size=1)
