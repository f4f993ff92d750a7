"""What the cluster tests share: a fixture-style context that makes a namespace cluster (skipping
with its one line where that is not permitted) and always removes it, checking nothing is left;
and a wait on torchrun agents with a hard deadline."""
from __future__ import annotations

import os
import signal
import subprocess
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
