"""torchrun on every host of a Cluster, as users launch on real nodes: one agent per host, the c10d
rendezvous on host 0's address.

    procs = start_torchrun(cluster, ["-m", "wideep.launch", "run", "--config", cfg], nproc_per_node=2)

Each agent runs inside its host with GLOO_SOCKET_IFNAME set to the host's wire device. With the
c10d backend torchrun ignores --node-rank and numbers the agents by sorting their --local-addr
(else hostname, which namespaces share): each host's address is given, so host i is node i
(for up to 9 hosts, where the addresses sort as numbers do). Host 0's agent is told it hosts the
rendezvous store (is_host=1): torchrun's own check compares the endpoint with this machine's
hostname and addresses, which a namespace's address is not among.
"""
from __future__ import annotations

import os
import subprocess
import sys

from wideep.launch.cli.local import LAUNCHER_VARS

from .cluster import Cluster

RDZV_PORT = 29400   # each host has its own network stack: no port is taken there


def torchrun_argv(cluster: Cluster, node: int, argv: list[str], nproc_per_node: int, rdzv_id: str) -> list[str]:
    host = cluster.hosts[node]
    return host.argv([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.hosts)),
                      "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", f"{cluster.hosts[0].addr}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
                      "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", host.addr, "--max-restarts", "0",
                      *argv])


def host_env(cluster: Cluster, node: int, nproc_per_node: int, extra: dict | None = None) -> dict:
    """This process's environment without an enclosing launcher's variables, gloo on the host's
    wire device, one intra-op thread per rank when the ranks outnumber the cores."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    threads = max(1, (os.cpu_count() or 1) // (nproc_per_node * len(cluster.hosts)))
    env.update(GLOO_SOCKET_IFNAME=cluster.hosts[node].dev, OMP_NUM_THREADS=str(threads), **(extra or {}))
    return env


def start_torchrun(cluster: Cluster, argv: list[str], nproc_per_node: int, rdzv_id: str = "wideep",
                   extra_env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """One torchrun agent per host, each in its own session (stop one with os.killpg(p.pid, ...));
    popen: subprocess.Popen keywords (a callable value is called with the node)."""
    if len(cluster.hosts) > 9:  # 198.18.X.10 sorts before 198.18.X.2: host 9 would not be node 9
        raise ValueError(f"start_torchrun numbers hosts by their addresses' order, which holds for up to 9 "
                         f"hosts; this cluster has {len(cluster.hosts)}")
    procs = []
    for node in range(len(cluster.hosts)):
        kw = {k: (v(node) if callable(v) else v) for k, v in popen.items()}
        procs.append(subprocess.Popen(torchrun_argv(cluster, node, argv, nproc_per_node, rdzv_id),
                                      env=host_env(cluster, node, nproc_per_node, extra_env),
                                      start_new_session=True, **kw))
    return procs
