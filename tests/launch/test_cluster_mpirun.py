"""Two namespace hosts x 2 ranks started by ONE `mpirun` (MPICH's hydra) with a hostfile of the hosts'
addresses, hydra's ssh launcher replaced by a script that enters the host's namespace
(launch/cluster/mpirun.py): bootstrap through mpi4py finds 2 nodes, the two-level dispatch prints
the greedy tokens of one process, and the inter-host wires carry the dispatcher's inter-node bytes
within the torchrun test's tolerances.

Skips with one line where mpirun or mpi4py is missing (pip install mpich mpi4py), or where network
namespaces cannot be made (not root, no iproute2, a container without the capability)."""
from __future__ import annotations

import json
import subprocess

import pytest

from wideep.launch.cluster import Cluster, Host
from wideep.launch.cluster.mpirun import find_mpirun, netns_ssh_script, start_mpirun
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.clusters import cluster_up, run_one_process, wait_agents
from tests.launch.runs import REPO, outputs
from tests.launch.test_cluster_torchrun import CONFIG, PROMPTS, TCP_TOLERANCE, WIRE_TOLERANCE

pytestmark = pytest.mark.multirank


@pytest.fixture
def cluster():
    with cluster_up() as c:
        yield c


@pytest.fixture
def mpi():
    if find_mpirun() is None:
        pytest.skip("mpirun not on PATH (pip install mpich mpi4py)")
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install mpi4py)")


def test_two_hosts_one_mpirun_equal_one_process(tmp_path, mpi, cluster):
    d = make_tiny_checkpoint(str(tmp_path / "m"), arch="v3", seed=4)
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(path=d, prompts=json.dumps(PROMPTS)))
    single = run_one_process(cfg)

    with open(tmp_path / "mpirun.log", "w+") as log:
        p = start_mpirun(cluster, ["-m", "wideep.launch", "run", "--config", str(cfg)], nproc_per_node=2,
                         workdir=tmp_path, extra_env={"PYTHONPATH": REPO}, cwd=REPO, stdout=log,
                         stderr=subprocess.STDOUT, text=True)
        rc = wait_agents([p], timeout_s=90)[0]
        log.seek(0)
        text = log.read()
    assert rc == 0, f"mpirun exit status {rc}\n{text[-5000:]}"
    assert outputs(text) == outputs(single.stdout) and len(outputs(text)) == len(PROMPTS)

    summary = json.loads([line for line in text.splitlines() if line.startswith('{"ranks"')][0])
    assert summary["ranks"] == 4 and summary["wire"]["dev"] == "eth0"
    per_rank = summary["dispatch_per_rank"]
    # mpirun's placement read as 2 nodes (mpi_topology): the two-level dispatch sent bytes between them
    payload = sum(s["dispatch_bytes_inter"] + s["combine_bytes_inter"] for s in per_rank)
    computed = payload + sum(s["meta_bytes_inter"] for s in per_rank)
    assert payload > 100_000, f"the dispatcher moved only {payload} B between nodes: mpirun's hosts not seen as nodes?"
    # hydra's own traffic (host 1's proxy forwarding its ranks' output to mpirun) stays within the same bound
    tcp, wire = sum(summary["wire"]["sent_payload_per_node"]), sum(summary["wire"]["sent_per_node"])
    print(f"on the wires {wire} B, TCP payload {tcp} B; dispatcher inter-node payload {payload} B + metadata "
          f"{computed - payload} B: ratios {wire / computed:.3f}, TCP payload {tcp / computed:.3f}")
    assert 1.0 <= tcp / computed <= 1.0 + TCP_TOLERANCE, (tcp, computed, summary["wire"])
    assert wire / computed <= 1.0 + WIRE_TOLERANCE, (wire, computed, summary["wire"])


def test_netns_ssh_refuses_an_address_of_no_host(tmp_path, cluster):
    """The launcher script answers an address that is no host of the cluster as ssh does (255),
    naming it, rather than running the command on this machine."""
    script = netns_ssh_script(cluster, tmp_path / "netns-ssh")
    bad = subprocess.run([str(script), "-x", "198.51.100.7", "echo", "ran"], capture_output=True, text=True, timeout=10)
    assert bad.returncode == 255 and "198.51.100.7 is no host of cluster" in bad.stderr and "ran" not in bad.stdout
    ok = subprocess.run([str(script), "-x", cluster.hosts[1].addr, "ip", "-4", "-o", "addr", "show", "dev", "eth0"],
                        capture_output=True, text=True, timeout=10)
    assert ok.returncode == 0 and cluster.hosts[1].addr in ok.stdout, ok


def test_start_mpirun_refuses_bad_input_before_starting_anything(tmp_path):
    hosts = [Host(i, f"wdfake-h{i}", f"198.18.9.{i + 1}") for i in range(2)]
    c = Cluster("wdfake", hosts, "wdfake-sw", None, None, None)   # never made: nothing may be started
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"nproc_per_node must be an integer >= 1, got {bad!r}"):
            start_mpirun(c, ["-c", "pass"], nproc_per_node=bad, workdir=tmp_path)
    c.hosts[1] = Host(1, "wdfake-h1", "198.18.9.2", dev="eth1")
    with pytest.raises(ValueError, match=r"wire devices differ \(\['eth0', 'eth1'\]\)"):
        start_mpirun(c, ["-c", "pass"], nproc_per_node=2, workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []
