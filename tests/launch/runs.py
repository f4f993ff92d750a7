"""`wideep run` once in one process and once on local ranks, for tests that compare the two; which
processes a launcher started and whether they still run (from /proc, Linux)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

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


class Started:
    """A server command started for a test (stdout and stderr read by a thread into `output`), waited for until
    `ready(line)` says a line shows it serving; its ranks' pids in `ranks` (the subclass fills them). Stopped by
    pid only: what the test started."""

    def __init__(self, cmd: list[str], env: dict, ready: Callable[[str], bool], start_timeout_s: float):
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.output: list[str] = []
        self.ranks: list[int] = []
        self.drained = threading.Event()
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"server did not start: {''.join(self.output)}") from None
            if ready(line):
                return

    def _drain(self, lines: queue.Queue) -> None:
        for line in self.proc.stdout:   # until every process sharing the pipe has closed it
            self.output.append(line)
            lines.put(line)
        self.drained.set()

    def wait(self, timeout_s: float) -> int | None:
        """-> the command's exit status; None (and everything killed) if it still runs after timeout_s."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        for pid in [*self.ranks, self.proc.pid]:   # by pid: only what this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def ranks_left(self, grace_s: float) -> list[int]:
        deadline = time.monotonic() + grace_s
        while any(alive(p) for p in self.ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in self.ranks if alive(p)]
