"""One mpirun (MPICH's hydra) over every host of a Cluster, as users launch on real nodes: a hostfile
of the hosts' addresses, mpirun started on host 0.

    p = start_mpirun(cluster, ["-m", "wideep.launch", "run", "--config", cfg], nproc_per_node=2, workdir=tmp)

Hydra reaches a host that is not its own by running its ssh launcher, `<launcher-exec> -x HOST
"hydra_pmi_proxy" --control-port ADDR:PORT ...`. There is no ssh into a namespace, so the launcher
is a small script (netns_ssh_script) with ssh's contract: skip the options, map HOST to its
namespace, run the rest through `sh -c` there. Host 0's proxy is forked by mpirun itself (HOST is
one of its own addresses). The proxies connect back to the control port at host 0's address,
which every host reaches through the switch. (mpirun in the root namespace works too, with
`-localhost <root address>`: else hydra advertises the hostname, which inside a namespace resolves
to that namespace's own loopback and the proxies fail "unable to connect to server".)

Every rank gets MASTER_ADDR = host 0's address (rank 0's hostname does not reach host 0 from the
others, parallel/bootstrap.py) and GLOO_SOCKET_IFNAME = the hosts' wire device (the same name on
every host: one -genv serves them all).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .cluster import Cluster
from .torchrun import host_env


def find_mpirun() -> str | None:
    """mpirun's path, or None where it is not installed (pip install mpich mpi4py)."""
    return shutil.which("mpirun")


def netns_ssh_script(cluster: Cluster, path: Path) -> Path:
    """Write at `path` an executable that hydra runs in place of ssh: `script [-opts] ADDR CMD...`
    runs CMD inside the host whose address is ADDR (any other address: exit 255, ssh's own code)."""
    cases = "\n".join(f"  {h.addr}) ns={shlex.quote(h.netns)};;" for h in cluster.hosts)
    path.write_text(f"""#!/bin/sh
# hydra's ssh launcher into the namespace hosts of cluster {cluster.prefix} (wideep.launch.cluster.mpirun)
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
  *) echo "{path.name}: $host is no host of cluster {cluster.prefix}" >&2; exit 255;;
esac
exec ip netns exec "$ns" sh -c "$*"
""")
    path.chmod(0o755)
    return path


def wire_dev(cluster: Cluster) -> str:
    """The hosts' wire device; ValueError where their names differ (one -genv names it for every rank)."""
    devs = sorted({h.dev for h in cluster.hosts})
    if len(devs) != 1:
        raise ValueError(f"the hosts' wire devices differ ({devs}): one GLOO_SOCKET_IFNAME cannot name them")
    return devs[0]


def mpirun_argv(cluster: Cluster, argv: list[str], nproc_per_node: int, mpirun: str, launcher: Path,
                hostfile: Path) -> list[str]:
    """`mpirun` on host 0 starting nproc_per_node ranks (python argv) on every host, node-major."""
    n = nproc_per_node * len(cluster.hosts)
    return cluster.hosts[0].argv([mpirun, "-launcher", "ssh", "-launcher-exec", str(launcher), "-f", str(hostfile),
                                  "-n", str(n), "-ppn", str(nproc_per_node),
                                  "-genv", "MASTER_ADDR", cluster.hosts[0].addr,
                                  "-genv", "GLOO_SOCKET_IFNAME", wire_dev(cluster), sys.executable, *argv])


def start_mpirun(cluster: Cluster, argv: list[str], nproc_per_node: int, workdir: Path,
                 extra_env: dict | None = None, **popen) -> subprocess.Popen:
    """mpirun (module doc) in its own session: stop it with os.killpg(p.pid, ...). hydra puts the
    ranks in process groups of their own, but each proxy ends its ranks when mpirun's control
    connection closes (measured: none left in the namespaces 1.5 s after SIGKILL or SIGTERM), and
    Cluster.down() ends by pid whatever is left. workdir receives the launcher script and the
    hostfile. popen: subprocess.Popen keywords."""
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
    wire_dev(cluster)
    mpirun = find_mpirun()
    if mpirun is None:
        raise FileNotFoundError("mpirun is not on PATH (pip install mpich mpi4py)")
    workdir = Path(workdir)
    launcher = netns_ssh_script(cluster, workdir / "netns-ssh")
    hostfile = workdir / "hosts"
    hostfile.write_text("".join(f"{h.addr}:{nproc_per_node}\n" for h in cluster.hosts))
    return subprocess.Popen(mpirun_argv(cluster, argv, nproc_per_node, mpirun, launcher, hostfile),
                            env=host_env(cluster, 0, nproc_per_node, extra_env), start_new_session=True, **popen)
