"""How rank 0 of a `wideep serve --dp-size N` deployment asks its supervisor (launch/cli/serve_local.py) for new
ranks when a resize grows it: two pipes the supervisor opens before it starts the ranks and hands to rank 0 only
(its file descriptors, named in WIDEEP_SPAWNER with the most ranks this host may run). One JSON line each way:

    rank 0 -> supervisor   {"start": [origin ranks], "world": M, "env": {...}}
    supervisor -> rank 0   {"pids": [...]}  |  {"error": "why"}

A deployment that another launcher started (torchrun, mpirun) has no link: it cannot grow, and the error says
what the operator runs instead.
"""
from __future__ import annotations

import json
import os
import select
from typing import Mapping

SPAWNER_ENV = "WIDEEP_SPAWNER"
REPLY_S = 30.0     # the supervisor starts processes (fork + exec), it does not wait for them to load


class SpawnError(RuntimeError):
    """The supervisor could not start the ranks (or is gone)."""


class Spawner:
    """Rank 0's end: start(origins, world, env) asks for the ranks and waits for the supervisor's answer."""

    def __init__(self, to_supervisor: int, from_supervisor: int, most: int):
        self._w, self._r, self.most = to_supervisor, from_supervisor, most

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Spawner | None":
        v = env.get(SPAWNER_ENV)
        if not v:
            return None
        w, r, most = (int(x) for x in v.split(","))
        return cls(w, r, most)

    def start(self, origins: list[int], world: int, env: dict[str, str]) -> list[int]:
        """-> the new ranks' pids. Raises SpawnError with the supervisor's reason."""
        line = json.dumps({"start": origins, "world": world, "env": env}).encode() + b"\n"
        try:
            os.write(self._w, line)
        except OSError as e:
            raise SpawnError(f"the supervisor that started this deployment is gone ({e})") from None
        reply = _read_line(self._r, REPLY_S)
        if reply is None:
            raise SpawnError(f"the supervisor did not answer within {REPLY_S:g} s")
        if "error" in reply:
            raise SpawnError(reply["error"])
        return reply["pids"]


class SupervisorEnd:
    """The supervisor's end: the pipes, the variable for rank 0, and one request at a time."""

    def __init__(self, most: int):
        self.req_r, self.req_w = os.pipe()
        self.rep_r, self.rep_w = os.pipe()
        self.most = most

    def env(self) -> dict[str, str]:
        return {SPAWNER_ENV: f"{self.req_w},{self.rep_r},{self.most}"}

    def rank0_fds(self) -> tuple[int, int]:
        return self.req_w, self.rep_r

    def poll(self, timeout_s: float) -> dict | None:
        """A request, if one comes within timeout_s."""
        return _read_line(self.req_r, timeout_s, eof_ok=True)

    def answer(self, reply: dict) -> None:
        try:
            os.write(self.rep_w, json.dumps(reply).encode() + b"\n")
        except OSError:
            pass   # rank 0 is gone: the supervisor notices on its own

    def close(self) -> None:
        for fd in (self.req_r, self.req_w, self.rep_r, self.rep_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _read_line(fd: int, timeout_s: float, eof_ok: bool = False) -> dict | None:
    """One JSON line from fd within timeout_s (bytes come in one write: lines are far below PIPE_BUF)."""
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if not ready:
        return None
    data = os.read(fd, 65536)
    if not data:
        if eof_ok:
            return None
        raise SpawnError("the supervisor that started this deployment is gone")
    return json.loads(data.decode().splitlines()[0])
