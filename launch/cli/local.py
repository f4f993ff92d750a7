"""Start N ranks on this host without a launcher (what `wideep demo` uses): torchrun-style env
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), one intra-op
thread per rank when ranks outnumber cores, and a hard deadline: ranks still running then are
killed by their process ids."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


# Variables of an enclosing launcher that would make a child join the wrong world.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nprocs: int, port: int, base: dict | None = None) -> dict:
    """torchrun's variables for local rank `rank` of `nprocs`, over `base` (default: this process's
    environment without an enclosing launcher's variables), one intra-op thread per rank when the
    ranks outnumber the cores."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in LAUNCHER_VARS}
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def start_ranks(cmd: list[str], nprocs: int, base: dict | None = None, port: int | None = None,
                **popen) -> list[subprocess.Popen]:
    """Start `cmd` as nprocs local ranks sharing one rendezvous port (default: a free one); popen:
    subprocess.Popen keywords (a callable value is called with the rank, e.g. stdout=lambda r: files[r])."""
    port = port or free_port()
    return [start_rank(cmd, rank, nprocs, port, base, **popen) for rank in range(nprocs)]


def start_rank(cmd: list[str], rank: int, nprocs: int, port: int, base: dict | None = None,
               **popen) -> subprocess.Popen:
    """One local rank of nprocs (also one more for a running deployment: a resize that grows it)."""
    kw = {k: (v(rank) if callable(v) else v) for k, v in popen.items()}
    return subprocess.Popen(cmd, env=rank_env(rank, nprocs, port, base), **kw)


def run_local_ranks(argv: list[str], nprocs: int, timeout_s: float = 600.0, *, cmd: list[str] | None = None,
                    capture: bool = False):
    """Run `python -m wideep.launch <argv>` (or `cmd`) on nprocs local ranks; rank 0's output goes to ours
    (or is captured), the others' only when they fail. -> the worst exit status (non-zero if any rank
    failed or timed out), and rank 0's stdout when capture is set."""
    cmd = cmd or [sys.executable, "-m", "wideep.launch", *argv]
    procs = start_ranks(cmd, nprocs, stdout=lambda r: None if r == 0 and not capture else subprocess.PIPE,
                        stderr=lambda r: None if r == 0 else subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    rank0_out = []
    if capture:  # drain rank 0's pipe while waiting, or a chatty rank 0 would block on a full pipe
        import threading
        reader = threading.Thread(target=lambda: rank0_out.append(procs[0].stdout.read()), daemon=True)
        reader.start()
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    timed_out = [p for p in procs if p.poll() is None]
    for p in timed_out:
        p.kill()  # by pid: only the processes started here
    worst = 0
    if capture:
        reader.join(timeout=5)
    for rank, p in enumerate(procs):
        rc = p.wait()
        if rank and rc != 0:
            out, err = p.communicate()
            sys.stderr.write(f"--- rank {rank} exited {rc} ---\n{(out or '')[-2000:]}{(err or '')[-4000:]}")
        worst = worst or rc
    if timed_out:
        print(f"wideep: {len(timed_out)} rank(s) still running after {timeout_s:.0f} s were killed", file=sys.stderr)
        worst = worst or 124
    return (worst, "".join(rank0_out)) if capture else worst
