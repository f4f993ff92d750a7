"""`wideep run` once in one process and once on local ranks, for tests that compare the two; which
processes a launcher started and whether they still run (from /proc, Linux)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from wideep.launch.cli.local import run_local_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def outputs(stdout: str) -> list[list[int]]:
    """The token ids `wideep run` printed, in prompt order."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"index"')]
    return [r["token_ids"] for r in sorted(rows, key=lambda r: r["index"])]


def run_single_and_ranks(single_argv: list[str], ranks_argv: list[str], nprocs: int, capfd) -> tuple[str, str]:
    """`python -m wideep.launch <single_argv>` in one process, then <ranks_argv> on nprocs local ranks
    (rank 0's output read through capfd); both must succeed. -> (single stdout, ranks stdout)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    single = subprocess.run([sys.executable, "-m", "wideep.launch", *single_argv], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    capfd.readouterr()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        rc = run_local_ranks(ranks_argv, nprocs, timeout_s=300)
    finally:
        os.chdir(cwd)
    multi = capfd.readouterr().out
    assert rc == 0
    return single.stdout, multi


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """pid runs (exists and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
