"""How `torchrun --nproc-per-node 2 -m wideep.launch serve MODEL_DIR` stops (127.0.0.1, gloo, hard timeouts).

torchrun starts each rank in its own session, so a terminal's Ctrl-C reaches only torchrun's agent.
The agent's handler raises SignalException, forwards the signal to every rank, waits for them, and
then lets the exception end torchrun: a traceback and exit status 1 however cleanly the ranks
stopped. Signalling rank 0 alone (its pid is printed) stops every rank, and torchrun exits 0.
Both are checked here, so the README stays true if either side changes.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

from wideep.launch.cli.local import free_port
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.runs import REPO, Started, children

pytestmark = pytest.mark.multirank


class Torchrun(Started):
    """torchrun --nproc-per-node 2 -m wideep.launch serve MODEL_DIR --port 0; waits for rank 0's first line."""

    def __init__(self, model: str, start_timeout_s: float = 180.0):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                                 "WIDEEP_API_KEY")}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=REPO)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "wideep.launch", "serve", model, "--port", "0",
               "--dispatch-backend", "torch", "--max-model-len", "64", "--kv-cache-blocks", "16"]
        super().__init__(cmd, env, self._ready, start_timeout_s)
        self.ranks = children(self.proc.pid)
        assert self.rank0 in self.ranks and len(self.ranks) == 2, (self.ranks, self.output)
        assert f"kill -INT {self.rank0} stops every rank" in self.first

    def _ready(self, line: str) -> bool:
        if "rank 0 is pid " in line:
            self.rank0 = int(line.split("rank 0 is pid ")[1].split(")")[0])
            self.first = line
            return True
        return False

    def wait(self, timeout_s: float = 90.0) -> int | None:
        return super().wait(timeout_s)

    def ranks_left(self, grace_s: float = 10.0) -> list[int]:
        return super().ranks_left(grace_s)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=4)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks' pids in /proc (Linux)")
def test_sigint_to_rank0_stops_every_rank_and_torchrun_exits_0(tiny):
    t = Torchrun(tiny)
    os.kill(t.rank0, signal.SIGINT)
    rc = t.wait()
    out = "".join(t.output)
    assert rc == 0, out
    assert t.ranks_left() == []
    assert "wideep serve: stopped\n" in out and "Traceback" not in out and "SignalException" not in out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks' pids in /proc (Linux)")
def test_sigint_to_torchrun_stops_every_rank_cleanly_but_torchrun_exits_1(tiny):
    """What Ctrl-C on torchrun does. If this starts failing because torchrun exits 0, torchrun has
    changed: update the README's "Stopping" note."""
    t = Torchrun(tiny)
    os.kill(t.proc.pid, signal.SIGINT)
    rc = t.wait()
    out = "".join(t.output)
    assert t.ranks_left() == []
    assert "wideep serve: stopped\n" in out            # rank 0 shut down gracefully and released rank 1
    assert "forcefully exiting" not in out             # no rank needed torchrun's SIGKILL
    assert "[rank1]: Traceback" not in out and "[rank0]: Traceback" not in out
    assert rc == 1 and "SignalException" in out, out
