"""`wideep serve MODEL --dp-size N` (or a run config's prefill/decode pools) without a launcher: start the
ranks on this host and supervise them (what vLLM's --data-parallel-size does on one node). The ranks are started by launch/cli/local.py's spawner
(torchrun's variables, as `wideep demo` uses), each runs `serve` exactly as under torchrun: rank 0 hosts
the HTTP front, the others follow it.

    supervisor (this process) ──SIGINT/SIGTERM──> rank 0 ──engine.shutdown()──> ranks 1..N-1

- Each rank is started in a session of its own, so a terminal's Ctrl-C reaches only the supervisor, which
  passes it to rank 0 once; rank 0 stops gracefully and releases the workers (they ignore the signals).
  Each rank also gets SIGTERM when the supervisor dies (Linux's parent-death signal), so even a SIGKILLed
  supervisor leaves no rank behind.
- A rank that dies is handled by the ranks, as under torchrun: with on_rank_loss = "exit" the survivors'
  watchdogs exit naming it (the supervisor then exits with rank 0's status); with "continue" they re-form
  and serve on, and the supervisor only reports the loss.
- Every wait is bounded: once rank 0 has exited, or STOP_GRACE_S after a stop was asked for, ranks still
  running get the collective timeout plus a margin, then are killed by their process groups.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .local import LAUNCHER_VARS, free_port, start_rank, start_ranks
from .spawn_link import SupervisorEnd

# More local ranks than this per usable core is refused: every rank loads the model and beats the lost-rank
# watchdog's heartbeat; squeezed further, a rank's share of a core cannot keep those beats on time.
RANKS_PER_CORE = 8
STOP_GRACE_S = 30.0    # a stop asked for: rank 0's graceful shutdown (aborts in-flight requests) gets this long
EXIT_MARGIN_S = 10.0   # past the collective timeout, for the survivors of a dead rank 0 to see it and exit
_PR_SET_PDEATHSIG = 1


def max_local_ranks(parallel: dict) -> tuple[int, str]:
    """-> (the most ranks this host may start, why): one GPU per rank with NCCL, else RANKS_PER_CORE per
    usable core."""
    backend = parallel.get("backend", "auto")
    if backend != "gloo":
        import torch
        if backend == "nccl" or torch.cuda.is_available():
            n = torch.cuda.device_count()
            return n, f"{n} CUDA device(s) on this host, one per rank"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return RANKS_PER_CORE * cpus, f"{RANKS_PER_CORE} ranks per usable CPU core, {cpus} core(s)"


@dataclass(frozen=True)
class LocalRanks:
    """What `serve` starts itself: `count` ranks whose collectives time out after timeout_s; a resize may grow
    them to `most` (this host's limit; 0: no growing, e.g. prefill/decode pools)."""
    count: int
    timeout_s: float
    most: int = field(default=0, compare=False)


def local_ranks(cfg: dict, env=None) -> LocalRanks | None:
    """-> the ranks `serve` must start itself, or None: under a launcher (every rank runs serve) or for one
    rank. The count is [parallel] dp_size, or with prefill/decode pools their ranks together
    (disagg/config.py). cfg: a validated run config (sizes >= 1 were checked there). Raises ValueError
    naming the numbers for a layout that cannot run here, before anything starts."""
    from wideep.disagg.config import DisaggConfig
    from wideep.parallel import ParallelConfig, under_launcher
    if under_launcher(env):
        return None
    par = {k: v for k, v in cfg.get("parallel", {}).items() if v != "auto"}
    dp, ep = par.get("dp_size"), par.get("ep_size")
    if "disagg" in cfg:   # sizes are per pool: [parallel] dp_size / ep_size are refused with pools
        from wideep.disagg.engine import check_options
        from .run_config import llm_kwargs
        kwargs = llm_kwargs(cfg)
        check_options(kwargs, kwargs["parallel"])
        dp = ep = DisaggConfig.from_dict(cfg["disagg"]).world_size
    if dp is None:
        if ep not in (None, 1):
            raise ValueError(f"ep_size ({ep}) without dp_size: routed experts are spread over every rank and "
                             f"each rank is one data-parallel rank; give --dp-size {ep} to start {ep} ranks")
        return None
    if ep is not None and ep != dp:
        raise ValueError(f"ep_size ({ep}) != dp_size ({dp}): routed experts are spread over every rank, so "
                         f"ep_size must equal the number of ranks; leave ep_size out or give --ep-size {dp}")
    if dp == 1:
        return None
    most, why = max_local_ranks(par)
    if dp > most:
        what = "the pools' dp_size" if "disagg" in cfg else "dp_size"
        raise ValueError(f"{what} ({dp}) is more ranks than this host can start: at most {most} ({why}); "
                         f"start ranks on several hosts with torchrun or mpirun")
    layout = ParallelConfig.from_dict({**par, "dp_size": dp, "ep_size": dp})
    layout.validate(dp)   # the rest of [parallel] (ranks_per_node ...), as every rank would check it
    return LocalRanks(dp, layout.timeout_s, 0 if "disagg" in cfg else most)


def _die_with(supervisor: int):
    """-> what a rank runs before exec: SIGTERM to itself when the supervisor dies (for rank 0, a graceful
    stop; the workers follow it). Off Linux there is no such signal; the supervisor's handlers remain."""
    def arm() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != supervisor:   # it died before prctl: the signal would never come
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL rank p's process group (its session: the rank and anything it started), only while p is
    unreaped, so its pid cannot name another process."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def serve_local_ranks(argv: list[str], nprocs: int, timeout_s: float, *, most: int = 0, poll_s: float = 0.1) -> int:
    """Run `python -m wideep.launch <argv>` (a serve command) on nprocs local ranks until rank 0 exits;
    timeout_s: the ranks' collective timeout ([parallel] timeout_s); most > 0: rank 0 may ask for more ranks,
    up to `most` running (a resize that grows the deployment: launch/cli/spawn_link.py). -> rank 0's exit
    status (128 + N if signal N killed it; 1 if a rank had to be killed here)."""
    asked: list[int] = []
    previous = {s: signal.signal(s, lambda sig, _f: asked.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    link = SupervisorEnd(most) if most else None
    cmd = [sys.executable, "-m", "wideep.launch", *argv]
    base = dict({k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}, **(link.env() if link else {}))
    port, me = free_port(), os.getpid()
    popen = dict(start_new_session=True, preexec_fn=lambda r: _die_with(me))
    try:
        procs = start_ranks(cmd, nprocs, base, port, pass_fds=lambda r: link.rank0_fds() if link and r == 0 else (),
                            **popen)
    except BaseException:
        for s, h in previous.items():
            signal.signal(s, h)
        if link:
            link.close()
        raise
    pids = ", ".join(str(p.pid) for p in procs)
    print(f"wideep serve: started {nprocs} local ranks (pids {pids}; supervisor pid {os.getpid()}); "
          f"Ctrl-C or kill -TERM {os.getpid()} stops them all", flush=True)

    def grow(req: dict) -> dict:
        """Rank 0 asks for new ranks (a resize): start them as this deployment's ranks, appended to procs."""
        origins, world = req["start"], req["world"]
        if origins != list(range(len(procs), len(procs) + len(origins))):
            return {"error": f"asked for ranks {origins}; the next new rank here is {len(procs)}"}
        running = sum(p.poll() is None for p in procs)
        if running + len(origins) > most:
            return {"error": f"{running} ranks run and {len(origins)} more would pass this host's limit of {most}"}
        try:
            new = [start_rank(cmd, o, world, port, dict(base, **req["env"]), **popen) for o in origins]
        except OSError as e:
            return {"error": f"could not start a process: {e}"}
        procs.extend(new)
        print(f"wideep serve: started rank(s) {', '.join(map(str, origins))} (pids "
              f"{', '.join(str(p.pid) for p in new)}) to grow the deployment to {world} ranks", flush=True)
        return {"pids": [p.pid for p in new]}

    try:
        return _supervise(procs, timeout_s, asked, poll_s, link, grow)
    finally:
        for p in procs:     # whatever went wrong here, no rank outlives the supervisor
            _kill_group(p)
        for s, h in previous.items():
            signal.signal(s, h)
        if link:
            link.close()


def _supervise(procs: list[subprocess.Popen], timeout_s: float, asked: list[int], poll_s: float,
               link: SupervisorEnd | None = None, grow=None) -> int:
    reported: set[int] = set()
    stop_at = None       # when the stop was passed to rank 0
    while procs[0].poll() is None:
        _report_exits(procs, reported, serving=True)
        if asked and stop_at is None:
            procs[0].send_signal(asked[0])   # unreaped, so the pid is still rank 0's
            stop_at = time.monotonic()
        if stop_at is not None and time.monotonic() - stop_at > STOP_GRACE_S:
            print(f"wideep serve: rank 0 did not stop within {STOP_GRACE_S:.0f} s: killing every rank",
                  file=sys.stderr, flush=True)
            return 1
        req = link.poll(poll_s) if link is not None else time.sleep(poll_s)
        if req is not None:
            link.answer(grow(req))
    # Rank 0 is gone: the workers leave once it released them, or once their watchdogs see it dead.
    deadline = time.monotonic() + timeout_s + EXIT_MARGIN_S
    while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
        time.sleep(poll_s)
    _report_exits(procs, reported)
    left = [r for r, p in enumerate(procs) if p.poll() is None]
    if left:
        print(f"wideep serve: rank(s) {left} still running {timeout_s + EXIT_MARGIN_S:.0f} s after rank 0 "
              f"exited: killed", file=sys.stderr, flush=True)
    rc = procs[0].returncode
    return (128 - rc if rc < 0 else rc) or (1 if left else 0)   # killed by signal N: 128 + N, as a shell says


def _report_exits(procs: list[subprocess.Popen], reported: set[int], serving: bool = False) -> None:
    """Name each worker that exited with a failure, once; and, while rank 0 runs, each that exited cleanly (a
    resize dropped it, or rank 0 is stopping). A clean exit after rank 0's is not news."""
    for rank, p in enumerate(procs[1:], 1):
        rc = p.poll()
        if rc is not None and (rc != 0 or serving) and rank not in reported:
            reported.add(rank)
            if rc == 0:
                print(f"wideep serve: rank {rank} (pid {p.pid}) exited (exit status 0)", flush=True)
                continue
            how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            print(f"wideep serve: rank {rank} (pid {p.pid}) exited ({how})", file=sys.stderr, flush=True)
