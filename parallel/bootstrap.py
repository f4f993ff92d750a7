"""bootstrap(cfg) -> ParallelContext: the one place processes find each other.

Three ways in, tried in this order:
- env (torchrun, or anything that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK and
  LOCAL_WORLD_SIZE default to a single host). Multi-node: `torchrun --nnodes N --node-rank i
  --master-addr HOST --master-port PORT --nproc-per-node G script.py`.
- mpirun (MPICH's hydra sets PMI_RANK/PMI_SIZE, Open MPI sets OMPI_COMM_WORLD_RANK/SIZE): rank and
  size from mpi4py's COMM_WORLD, local rank from a shared-memory split. Rank 0 opens the rendezvous
  store on MASTER_PORT (or any free port) at MASTER_ADDR (or 127.0.0.1 when every rank is on its host,
  else its hostname) and broadcasts the address. Multi-node: `mpirun -hostfile hosts -n N python
  script.py`; set MASTER_ADDR (e.g. `-x MASTER_ADDR=node0` / `-genv MASTER_ADDR node0`) when the
  hostname of rank 0 does not resolve from the other nodes.
- neither: one process, ParallelContext.single() (no torch.distributed).
Nodes (parallel/topology.py): torchrun's LOCAL_WORLD_SIZE and GROUP_RANK, mpirun's hosts, or
`[parallel] ranks_per_node` to simulate several nodes on one host; with more than one node every
rank also gets its node's process group.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .agreement import check_agreement
from .config import ParallelConfig
from .context import ParallelContext
from .topology import Topology, mpi_topology, new_node_group
from .watchdog import Watchdog

STORE_PREFIX = "wideep/"
# What mpirun sets (MPICH's hydra: PMI_*, Open MPI: OMPI_COMM_WORLD_*, PMIx): a rank of an MPI job.
MPI_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


@dataclass
class _Launch:
    kind: str                 # "torchrun" | "mpirun" | "single"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0        # among the processes on this host (device index, CPU threads)
    local_world_size: int = 1
    topology: Topology | None = None
    addr: str = "127.0.0.1"
    port: int = 0
    agent_store: bool = False  # torchrun's agent hosts the store; ranks are all clients
    mpi_comm: Any = None


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    v = env.get(name)
    if v is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set (RANK and WORLD_SIZE are; "
                             f"a launcher must set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _detect(env: Mapping[str, str]) -> _Launch:
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        if world == 1:
            return _Launch("single")
        if "MASTER_ADDR" not in env:
            raise ValueError("environment variable MASTER_ADDR is not set (RANK and WORLD_SIZE are)")
        local, local_world = _env_int(env, "LOCAL_RANK", rank), _env_int(env, "LOCAL_WORLD_SIZE", world)
        node = _env_int(env, "GROUP_RANK") if "GROUP_RANK" in env else None
        topo = Topology.from_launcher(rank, world, local, local_world, node,
                                      source="the launcher (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)")
        return _Launch("torchrun", rank, world, local, local_world, topo, env["MASTER_ADDR"],
                       _env_int(env, "MASTER_PORT"),
                       agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
    if any(k in env for k in MPI_VARS):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise RuntimeError("started under mpirun (PMI_*/OMPI_* variables are set) but mpi4py is not "
                               "installed: pip install mpi4py") from e
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        if world == 1:
            return _Launch("single")
        topo = mpi_topology(comm, rank, world)
        return _Launch("mpirun", rank, world, topo.local_rank, topo.ranks_per_node, topo, mpi_comm=comm)
    return _Launch("single")


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun (RANK and WORLD_SIZE) or mpirun (MPI_VARS) started this process: then it is one of
    the ranks, never the one that starts them."""
    env = os.environ if env is None else env
    return ("RANK" in env and "WORLD_SIZE" in env) or any(k in env for k in MPI_VARS)


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as the launcher announced it (0 when started plainly), readable before
    bootstrap (e.g. to set up signal handling before a long model load)."""
    env = os.environ if env is None else env
    for key in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in env:
            return _env_int(env, key)
    return 0


def launch_world_size(env: Mapping[str, str] | None = None) -> int:
    """The world size a launcher announced in the environment (1 when started plainly), read before
    bootstrap so that "auto" sizes can be resolved without connecting."""
    env = os.environ if env is None else env
    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if key in env:
            return _env_int(env, key)
    return 1


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use 'gloo'")
    return backend


def _limit_cpu_threads(local_world_size: int) -> None:
    # Ranks on one host share its cores. With more intra-op threads than cores per rank, MKL/OpenMP
    # threads spin against each other and matmuls get hundreds of times slower.
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_rank = max(1, cpus // local_world_size)
    if per_rank < torch.get_num_threads():
        torch.set_num_threads(per_rank)


def _open_store(launch: _Launch, env: Mapping[str, str], timeout: timedelta) -> dist.TCPStore:
    if launch.kind == "mpirun":
        comm = launch.mpi_comm
        store, addr, port = None, None, None
        if launch.rank == 0:
            all_local = launch.local_world_size == launch.world_size
            addr = env.get("MASTER_ADDR") or ("127.0.0.1" if all_local else socket.gethostname())
            # Port 0: the store binds a free port itself, so there is no pick-then-bind race.
            store = dist.TCPStore(addr, int(env.get("MASTER_PORT", 0)), launch.world_size, True,
                                  timeout=timeout, wait_for_workers=False)
            port = store.port
        launch.addr, launch.port = comm.bcast((addr, port), root=0)
        if store is not None:
            return store
        return dist.TCPStore(launch.addr, launch.port, launch.world_size, False, timeout=timeout)
    is_master = launch.rank == 0 and not launch.agent_store
    return dist.TCPStore(launch.addr, launch.port, launch.world_size, is_master, timeout=timeout,
                         wait_for_workers=False)


def bootstrap(cfg: ParallelConfig | None = None, *, env: Mapping[str, str] | None = None) -> ParallelContext:
    """Join the other ranks (or not, for one process) and return this rank's context.

    Validates cfg against the world size before any connection is made (same error on every rank),
    starts the lost-rank watchdog, and checks that every rank got the same cfg.
    """
    cfg = cfg or ParallelConfig()
    env = os.environ if env is None else env
    launch = _detect(env)
    cfg.validate(launch.world_size)
    backend = _resolve_backend(cfg.backend)
    device = torch.device(f"cuda:{launch.local_rank}") if backend == "nccl" else torch.device("cpu")
    if launch.kind == "single":
        return ParallelContext.single(device)
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        _limit_cpu_threads(launch.local_world_size)

    topo = launch.topology
    if cfg.ranks_per_node:
        topo = topo.simulate(cfg.ranks_per_node)
    timeout = timedelta(seconds=cfg.timeout_s)
    store = _open_store(launch, env, timeout)
    dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                            timeout=timeout, **({"device_id": device} if backend == "nccl" else {}))
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    node_group = new_node_group(topo, backend, timeout) or world

    addr, port = launch.addr, launch.port
    # Keys of an earlier attempt stay in torchrun's agent store across restarts: never read them.
    prefix = f"{STORE_PREFIX}{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    def watchdog_store():
        # The process's own client: no connection of its own, so no burst of W connects at start-up.
        return dist.PrefixStore(prefix, store)

    watch = watch_settings(cfg, None if launch.agent_store else 0, addr, port, launch.topology.num_nodes > 1)
    watchdog = Watchdog(watchdog_store, launch.rank, launch.world_size, **watch).start()
    # Attention TP = 1: every rank is its own DP rank, and the one EP group is the world.
    ctx = ParallelContext(
        rank=launch.rank, world_size=launch.world_size, local_rank=topo.local_rank,
        local_world_size=topo.ranks_per_node, node_rank=topo.node_rank, num_nodes=topo.num_nodes,
        device=device, backend=backend, dp_rank=launch.rank, dp_size=cfg.dp_size, ep_rank=launch.rank,
        ep_size=cfg.ep_size, ep_group=world, cpu_group=cpu_group, node_group=node_group, store=store,
        timeout_s=cfg.timeout_s, launcher=launch.kind, watchdog=watchdog, on_rank_loss=cfg.on_rank_loss,
        watch_settings=watch)
    check_agreement(ctx, json.dumps(cfg.to_dict(), sort_keys=True), "parallel config")
    return ctx


def watch_settings(cfg: ParallelConfig, store_host_rank: int | None, addr: str, port: int,
                   several_hosts: bool) -> dict:
    """The Watchdog's keywords (all but the store) for ranks whose rendezvous store listens at addr:port."""
    bind, advertise = _ring_address(addr, several_hosts)
    return dict(heartbeat_s=cfg.heartbeat_s, timeout_s=cfg.timeout_s, lost_after_s=cfg.lost_after_s,
                store_host_rank=store_host_rank, store_addr=(addr, port), host=bind, advertise=advertise,
                on_lost=_keep_running if cfg.on_rank_loss == "continue" else None)


def _keep_running(ranks: list[int], msg: str) -> None:
    """on_rank_loss = "continue": the survivors re-form (parallel/reform.py) when their step loop
    notices; only the front's loss ends the job (rank 0 holds the requests and the store)."""
    if 0 in ranks:
        print(f"{msg}; the front is lost: exiting", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    print(f"{msg}; the survivors re-form (on_rank_loss = continue)", file=sys.stderr, flush=True)


def _ring_address(store_addr: str, several_hosts: bool) -> tuple[str, str | None]:
    """(address the watchdog listens on, address it publishes or None for the bound one): the
    local address that routes to the store, which the other hosts can reach. A store address that
    is loopback means one host; a host name that resolves to loopback here (Debian's 127.0.1.1)
    while there are several hosts means: listen everywhere, publish the host name."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(store_addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # UDP: no packet is sent, the kernel only picks the route
            local = s.getsockname()[0]
    except OSError:
        local = None
    if local is None or (several_hosts and ipaddress.ip_address(local).is_loopback
                         and not _is_loopback_literal(store_addr)):
        return ("0.0.0.0", socket.getfqdn()) if several_hosts else ("127.0.0.1", None)
    return local, None


def _is_loopback_literal(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def shutdown(ctx: ParallelContext) -> None:
    """Stop the watchdog (telling peers this rank left on purpose) and destroy the process group."""
    if ctx.watchdog is not None:
        ctx.watchdog.stop(done=True)
        ctx.watchdog = None
    if dist.is_initialized():
        dist.destroy_process_group()
    ctx.ep_group = ctx.cpu_group = ctx.store = None
