"""What the cluster tests share: a fixture-style context that makes a namespace cluster (skipping
with its one line where that is not permitted) and always removes it, checking nothing is left;
a wait on torchrun agents with a hard deadline; a poller of the front's /health."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

from wideep.launch.cluster import Cluster, ClusterSpec, ClusterUnavailable


@contextmanager
def cluster_up(nodes: int = 2, rate: str | None = "5gbit"):
    try:
        c = Cluster.up(ClusterSpec(nodes=nodes, rate=rate), owner_pid=os.getpid())
    except ClusterUnavailable as e:
        pytest.skip(str(e))
    try:
        yield c
    finally:
        c.down()
        assert c.leftovers() == [], c.leftovers()


def wait_agents(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Each agent's exit status; an agent still running at the deadline is killed with its ranks
    (its process group: each agent leads its own session) and reported as None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    late = [p.poll() is None for p in procs]
    for p, is_late in zip(procs, late):
        if is_late:
            os.killpg(p.pid, signal.SIGKILL)
    return [None if is_late else p.wait() for p, is_late in zip(procs, late)]


def run_one_process(cfg) -> subprocess.CompletedProcess:
    """`wideep run --config cfg` in one process (what the hosts' ranks must equal): its completed process."""
    import sys
    from tests.launch.runs import REPO
    single = subprocess.run([sys.executable, "-m", "wideep.launch", "run", "--config", str(cfg)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    return single


def run_torchrun(cluster, cfg, log_dir, timeout_s: float = 150) -> list[str]:
    """`wideep run --config cfg` under torchrun on every host of the cluster, 2 ranks each: each host's output;
    asserts every agent exited 0 (the tails of both outputs otherwise)."""
    from wideep.launch.cluster.torchrun import start_torchrun
    from tests.launch.runs import REPO
    logs = [open(f"{log_dir}/host{n}.log", "w+") for n in range(len(cluster.hosts))]
    procs = start_torchrun(cluster, ["-m", "wideep.launch", "run", "--config", str(cfg)], nproc_per_node=2,
                           extra_env={"PYTHONPATH": REPO}, cwd=REPO, stdout=lambda n: logs[n],
                           stderr=subprocess.STDOUT, text=True)
    rcs = wait_agents(procs, timeout_s=timeout_s)
    text = []
    for f in logs:
        f.seek(0)
        text.append(f.read())
        f.close()
    assert rcs == [0] * len(procs), (f"exit statuses {rcs}\n"
                                     + "\n".join(f"--- host {n} ---\n{t[-4000:]}" for n, t in enumerate(text)))
    return text


class HealthProbe:
    """GET /health every interval_s on a thread while the block runs: [(t, status, body)] (status
    None where the front did not answer). mark() notes where the loss starts."""

    def __init__(self, base: str, interval_s: float = 0.05):
        from tests.launch.test_server import request
        self.base, self.interval_s, self._request = base, interval_s, request
        self.seen: list[tuple[float, int | None, dict]] = []
        self.marked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, raw = self._request(self.base, "GET", "/health", timeout_s=10)
                self.seen.append((time.monotonic(), status, json.loads(raw)))
            except OSError as e:
                self.seen.append((time.monotonic(), None, {"error": repr(e)}))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def mark(self) -> None:
        self.marked = len(self.seen)

    def sequence(self) -> list[str]:
        """The states seen after mark(), repeats folded: e.g. ["ok", "503 reforming", "degraded"]."""
        out: list[str] = []
        for _, status, body in self.seen[self.marked:]:
            name = body.get("status") if status == 200 else f"{status} {body.get('status')}"
            if not out or out[-1] != name:
                out.append(name)
        return out

    def check_loss_survived(self, lost: list[int], survivors: list[int], states: tuple[list[str], ...]) -> None:
        """Before mark(): "ok" only. After: one of `states` (sequence()), every 503 "reforming"
        naming some of `lost`, every 503 "unreachable" some of them as silent; the last answer 200
        "degraded" naming all of them and the survivors."""
        before, after = self.seen[:self.marked], self.seen[self.marked:]
        assert before and all(st == 200 and b == {"status": "ok"} for _, st, b in before), before
        seq = self.sequence()
        assert seq in states, (seq, after)
        for _, st, b in after:
            if st == 503:
                assert b["serving"] is False, b
                if b["status"] == "unreachable":
                    assert {u["rank"] for u in b["unreachable"]} <= set(lost) and "silent" in b["error"]["message"], b
                else:
                    assert b["lost_ranks"] and set(b["lost_ranks"]) <= set(lost), b
                    assert "lost" in b["error"]["message"], b
        last = after[-1][2]
        assert last["lost_ranks"] == lost and last["serving_ranks"] == survivors and last["serving"], last
