"""Run a function on N local ranks (separate Python processes) with a hard timeout.

    from tests.parallel.spawn import spawn
    results = spawn(my_rank_fn, 4, args=(...,), timeout_s=90)      # [value of rank 0, 1, 2, 3]

my_rank_fn must live in an importable module (a test module is fine) and take picklable arguments;
it runs in a fresh interpreter with torchrun's variables set (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>), GLOO_SOCKET_IFNAME=lo and one
intra-op thread, and does its own bootstrap. spawn() returns each rank's (picklable) return value,
or raises RanksFailed carrying every failed rank's traceback and stderr. launcher="mpirun" starts
the ranks with `mpirun -n N` instead (no RANK variables; bootstrap goes through mpi4py);
launcher="torchrun" with nnodes=K starts K torchrun launchers on this host, node i with
`--nnodes K --node-rank i --nproc-per-node N/K` and one rendezvous endpoint (127.0.0.1), as on K nodes.

On timeout every process started here is killed (by its pid / process group; ranks a launcher
started, by the pid each rank wrote at start) and SpawnTimeout is raised with the output so far. run() gives the raw per-rank outcomes without raising on failures,
for tests where ranks are expected to die.
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from wideep.launch.cli.local import LAUNCHER_VARS, free_port, start_ranks  # noqa: F401 (free_port: for tests)

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import importlib, os, pickle, sys, traceback
rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
with open(f"{sys.argv[2]}.pid.{rank}", "w") as f:
    f.write(str(os.getpid()))
try:
    import torch
    torch.set_num_threads(1)  # ranks share 2 cores: more threads make MKL hundreds of times slower
    with open(sys.argv[1], "rb") as f:
        module, qualname, args, kwargs = pickle.load(f)
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    result = ("ok", fn(*args, **kwargs))
except BaseException:
    tb = traceback.format_exc()
    print(tb, file=sys.stderr, flush=True)
    result = ("error", tb)
# written aside and renamed: a rank ended mid-write (a watchdog's exit) leaves no half-written result
with open(f"{sys.argv[2]}.{rank}.part", "wb") as f:
    try:
        pickle.dump(result, f)
    except Exception as e:
        f.seek(0); f.truncate(); pickle.dump(("error", f"rank result is not picklable: {e!r}"), f)
os.replace(f"{sys.argv[2]}.{rank}.part", f"{sys.argv[2]}.{rank}")
sys.stdout.flush(); sys.stderr.flush()
if "mpi4py.MPI" in sys.modules and result[0] == "ok":
    sys.modules["mpi4py.MPI"].Finalize()
# os._exit: a finished rank must not hang in interpreter teardown (process-group destructors).
os._exit(0 if result[0] == "ok" else 1)
"""


@dataclass
class RankOutcome:
    rank: int
    returncode: int | None      # None: killed at the timeout
    value: Any = None           # fn's return value when ok
    error: str | None = None    # traceback when fn raised; None when ok or when no result was written
    stdout: str = ""
    stderr: str = ""            # with launcher="mpirun", the merged output of all ranks
    elapsed_s: float = 0.0      # from start until this rank's process exited

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None


class RanksFailed(AssertionError):
    pass


class SpawnTimeout(AssertionError):
    pass


def _base_env(extra: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def run(fn: Callable, nprocs: int, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float = 60.0,
        env: dict | None = None, launcher: str = "env", nnodes: int = 1) -> list[RankOutcome]:
    """Start nprocs ranks of fn(*args, **kwargs); wait for all to exit. Raises SpawnTimeout after
    killing them if they are not all done within timeout_s; otherwise returns every rank's outcome."""
    if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable module")
    tmp = Path(tempfile.mkdtemp(prefix="wideep-spawn-"))
    try:
        argfile, outprefix = tmp / "args.pkl", tmp / "result"
        with open(argfile, "wb") as f:
            pickle.dump((fn.__module__, fn.__qualname__, tuple(args), dict(kwargs or {})), f)
        child = [sys.executable, "-c", _CHILD, str(argfile), str(outprefix)]
        base = _base_env(env)
        procs: list[tuple[subprocess.Popen, Path, Path]] = []
        if launcher == "env":
            files = [(open(tmp / f"out.{r}", "wb"), open(tmp / f"err.{r}", "wb")) for r in range(nprocs)]
            started = start_ranks(child, nprocs, base, cwd=REPO, stdout=lambda r: files[r][0],
                                  stderr=lambda r: files[r][1], stdin=subprocess.DEVNULL, start_new_session=True)
            for r, (p, (fo, fe)) in enumerate(zip(started, files)):
                fo.close()
                fe.close()
                procs.append((p, tmp / f"out.{r}", tmp / f"err.{r}"))
        elif launcher == "mpirun":
            mpirun = shutil.which("mpirun")
            if mpirun is None:
                raise FileNotFoundError("mpirun is not on PATH (pip install mpich mpi4py)")
            procs.append(_popen([mpirun, "-n", str(nprocs)] + child, base, tmp / "out.all", tmp / "err.all"))
        elif launcher == "torchrun":
            if nprocs % nnodes:
                raise ValueError(f"nnodes ({nnodes}) must divide nprocs ({nprocs})")
            script = tmp / "child.py"
            script.write_text(_CHILD)
            port = free_port()
            for node in range(nnodes):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
                       str(node), "--nproc-per-node", str(nprocs // nnodes), "--master-addr", "127.0.0.1",
                       "--master-port", str(port), str(script), str(argfile), str(outprefix)]
                procs.append(_popen(cmd, base, tmp / f"out.node{node}", tmp / f"err.node{node}"))
        else:
            raise ValueError(f"launcher must be 'env', 'mpirun' or 'torchrun', got {launcher!r}")

        start = time.monotonic()
        exited: dict[int, float] = {}
        while len(exited) < len(procs):
            for i, (p, _, _) in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                for i, (p, _, _) in enumerate(procs):
                    if i not in exited:
                        _kill(p)
                _kill_ranks(outprefix, nprocs)
                outs = _collect(procs, outprefix, nprocs, exited, launcher)
                raise SpawnTimeout(f"{nprocs} ranks of {fn.__qualname__} not done after {timeout_s} s; killed.\n"
                                   + _report(outs))
            time.sleep(0.05)
        _kill_ranks(outprefix, nprocs)  # a launcher that exited may have left ranks behind
        return _collect(procs, outprefix, nprocs, exited, launcher)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def spawn(fn: Callable, nprocs: int, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float = 60.0,
          env: dict | None = None, launcher: str = "env", nnodes: int = 1) -> list[Any]:
    """run(), then return the ranks' values in rank order, or raise RanksFailed naming each failure."""
    outs = run(fn, nprocs, args, kwargs, timeout_s=timeout_s, env=env, launcher=launcher, nnodes=nnodes)
    failed = [o for o in outs if not o.ok]
    if failed:
        raise RanksFailed(f"ranks {[o.rank for o in failed]} of {fn.__qualname__} failed:\n" + _report(failed))
    return [o.value for o in outs]


def _popen(cmd, env, out: Path, err: Path):
    # Own session, so that a kill reaches what the rank started (mpirun's children) and nothing else.
    with open(out, "wb") as fo, open(err, "wb") as fe:
        p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    return p, out, err


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.wait()


def _kill_ranks(outprefix: Path, nprocs: int) -> None:
    """SIGKILL, by the pid it wrote, every rank process still alive (a launcher's ranks run in
    sessions of their own, out of reach of a kill of the launcher's process group)."""
    for r in range(nprocs):
        try:
            pid = int(Path(f"{outprefix}.pid.{r}").read_text())
            # the pid may be reused once the rank is gone: only a process running our child script
            if str(outprefix).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _collect(procs, outprefix: Path, nprocs: int, exited: dict, launcher: str) -> list[RankOutcome]:
    texts = [(o.read_text(errors="replace"), e.read_text(errors="replace")) for _, o, e in procs]
    outs = []
    per_launcher = nprocs // len(procs)
    for r in range(nprocs):
        i = r // per_launcher
        p = procs[i][0]
        o = RankOutcome(r, p.returncode if i in exited else None, stdout=texts[i][0], stderr=texts[i][1],
                        elapsed_s=exited.get(i, float("nan")))
        res = Path(f"{outprefix}.{r}")
        if res.exists():
            status, payload = pickle.loads(res.read_bytes())
            if status == "ok":
                o.value = payload
            else:
                o.error = payload
        elif o.returncode == 0:
            o.error = "exited 0 without writing a result"
        outs.append(o)
    return outs


def _report(outs: list[RankOutcome], tail: int = 4000) -> str:
    parts = []
    for o in outs:
        parts.append(f"--- rank {o.rank}: returncode {o.returncode}, {o.elapsed_s:.1f} s ---")
        if o.error:
            parts.append(o.error[-tail:])
        if o.stderr.strip():
            parts.append("stderr:\n" + o.stderr[-tail:])
    return "\n".join(parts)
