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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_ranks(argv: list[str], nprocs: int, timeout_s: float = 600.0, *, cmd: list[str] | None = None,
                    capture: bool = False):
    """Run `python -m launch <argv>` (or `cmd`) on nprocs local ranks; rank 0's output goes to ours
    (or is captured), the others' only when they fail. -> the worst exit status (non-zero if any rank
    failed or timed out), and rank 0's stdout when capture is set."""
    cmd = cmd or [sys.executable, "-m", "launch", *argv]
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        out = None if rank == 0 and not capture else subprocess.PIPE
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=None if rank == 0 else out, text=True))
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
