"""The local cluster harness (launch/cluster/): bad specs named, one line without the privilege,
shaped links whose counters see what crossed, and nothing left behind, also after the process that
made the cluster was killed. The namespace tests skip with one line where namespaces cannot be made."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from wideep.launch.cli.main import main
from wideep.launch.cluster import Cluster, ClusterSpec, ClusterUnavailable, netns, rate_bits, state
from tests.launch.runs import REPO


@pytest.mark.parametrize("kw,match", [
    (dict(nodes=0), r"nodes must be an integer in \[1, 200\], got 0"),
    (dict(nodes=2, rate="5gb"), r"link rate must be .* got '5gb'"),
    (dict(nodes=2, rate="-1gbit"), r"got '-1gbit'"),
    (dict(nodes=2, prefix="Wd-1"), r"prefix must be 2-8 characters .* got 'Wd-1'"),
    (dict(nodes=2, prefix="toolongname"), r"got 'toolongname'"),
])
def test_bad_specs(kw, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(**kw)


def test_rates():
    assert rate_bits("5gbit") == 5 * 10**9 and rate_bits("2.5gbit") == 25 * 10**8 and rate_bits("800mbit") == 8 * 10**8


def test_without_root_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match=r"needs root to make network namespaces \(running as uid 1000\)"):
        Cluster.up(ClusterSpec(nodes=2))
    with pytest.raises(SystemExit) as e:
        main(["cluster", "up", "--nodes", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "needs root" in err, err


def _up(**kw) -> Cluster:
    try:
        return Cluster.up(ClusterSpec(**kw), owner_pid=os.getpid())
    except ClusterUnavailable as e:
        pytest.skip(str(e))


def _gone(c: Cluster) -> None:
    assert c.leftovers() == [] and not os.path.exists(state.path(c.prefix)), c.leftovers()
    assert not any(ns.startswith(c.prefix + "-") for ns in netns.namespaces())


SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 5001)); print("ready", flush=True); c, _ = s.accept(); n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
print(n, flush=True)
"""
CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001)); t = time.perf_counter(); s.sendall(bytes(int(sys.argv[2])))
s.shutdown(socket.SHUT_WR); s.recv(1); print(time.perf_counter() - t)
"""


def test_shaped_hosts_counters_and_down():
    c = _up(nodes=2, rate="200mbit")
    try:
        h0, h1 = c.hosts
        assert (h0.addr, h1.addr, c.root_addr) == tuple(c.root_addr.rsplit(".", 1)[0] + s for s in (".1", ".2", ".254"))
        for h in c.hosts:
            qd = netns.run("ip", "netns", "exec", h.netns, "tc", "qdisc", "show", "dev", h.dev).stdout
            assert "tbf" in qd and "rate 200Mbit" in qd, qd
            qd = netns.run("ip", "netns", "exec", c.switch, "tc", "qdisc", "show", "dev", h.port).stdout
            assert "tbf" in qd and "rate 200Mbit" in qd, qd
            assert "UP" in netns.run("ip", "-n", h.netns, "link", "show", "dev", "lo").stdout
        n = 4_000_000
        server = subprocess.Popen(h1.argv([sys.executable, "-c", SERVER, h1.addr]), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            before = c.link_bytes()
            client = subprocess.run(h0.argv([sys.executable, "-c", CLIENT, h1.addr, str(n)]), capture_output=True,
                                    text=True, timeout=30)
            assert client.returncode == 0, client.stderr
            assert int(server.stdout.readline()) == n
        finally:
            server.kill()
            server.wait()
        d0, d1 = (b - a for a, b in zip(before, c.link_bytes()))
        # every payload byte is on the wire once, plus one header per (GSO) frame and the ACKs; host 1
        # gets what host 0 sent (and at most an ARP broadcast or two from elsewhere on the bridge)
        assert n <= d0.sent <= n * 1.02 and d0.sent <= d1.received <= d0.sent + 200, (d0, d1)
        assert d1.sent < n * 0.02, d1
        took = float(client.stdout)
        assert took >= 0.8 * n * 8 / 200e6, f"{n} bytes in {took:.3f} s: faster than the 200mbit link allows"
    finally:
        c.down()
    _gone(c)


def test_down_after_the_owner_was_killed():
    """A cluster whose maker was SIGKILLed (no finalizer ran) is removed by `wideep cluster down --prefix`."""
    maker = textwrap.dedent("""
        import os, sys, time
        from wideep.launch.cluster import Cluster, ClusterSpec, ClusterUnavailable
        try:
            c = Cluster.up(ClusterSpec(nodes=2, rate="1gbit"), owner_pid=os.getpid())
        except ClusterUnavailable as e:
            print("skip", e, flush=True)
            sys.exit(0)
        print(c.prefix, flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", maker], stdout=subprocess.PIPE, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO))
    line = p.stdout.readline().strip()
    if line.startswith("skip"):
        p.wait()
        pytest.skip(line[5:])
    prefix = line
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    c = Cluster.load(prefix)
    try:
        assert set(c.leftovers()) == {f"{prefix}-h0", f"{prefix}-h1", f"{prefix}-sw", prefix}
        assert not state.owner_alive(state.load(prefix))
        main(["cluster", "down", "--prefix", prefix])
    finally:
        c.down()
    time.sleep(0.1)
    _gone(c)


def test_two_clusters_at_once_get_their_own_names_and_subnets():
    a = _up(nodes=1, rate=None)
    try:
        b = _up(nodes=1, rate=None)
        try:
            assert a.prefix != b.prefix and a.hosts[0].addr != b.hosts[0].addr
            with pytest.raises(ValueError, match=f"a cluster with prefix '{a.prefix}' exists already"):
                Cluster.up(ClusterSpec(nodes=1, prefix=a.prefix))
        finally:
            b.down()
        assert a.leftovers() and not b.leftovers()   # removing one leaves the other alone
    finally:
        a.down()
    _gone(a)
    _gone(b)


def test_torchrun_refuses_more_hosts_than_address_order_numbers():
    from wideep.launch.cluster import Host
    from wideep.launch.cluster.torchrun import start_torchrun
    c = Cluster("wdfake", [Host(i, f"wdfake-h{i}", f"198.18.9.{i + 1}") for i in range(10)], "wdfake-sw", None, None,
                None)   # never made: start_torchrun refuses before starting anything
    with pytest.raises(ValueError, match="up to 9 hosts; this cluster has 10"):
        start_torchrun(c, ["-c", "pass"], nproc_per_node=1)


REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close(); print("reached")
except OSError as e:
    print(type(e).__name__)
"""


def test_link_down_is_a_silent_partition_and_up_restores_it(capsys):
    """`wideep cluster link --node 1 down`: a connect from host 0 to a listener on host 1 times out (no
    refusal: silence, as with a pulled cable), while host 1 still reaches itself; `up` restores it."""
    c = _up(nodes=2, rate=None)
    try:
        h0, h1 = c.hosts
        server = subprocess.Popen(h1.argv([sys.executable, "-c", "import socket, sys, time; s = socket.create_server("
                                           "(sys.argv[1], 5002), backlog=8); print('ready', flush=True); time.sleep(60)",
                                           h1.addr]), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"

            def reach(host, timeout_s=1.0):
                return subprocess.run(host.argv([sys.executable, "-c", REACH, h1.addr, "5002", str(timeout_s)]),
                                      capture_output=True, text=True, timeout=30).stdout.strip()
            assert reach(h0) == "reached" and c.link_up(1)
            main(["cluster", "link", "--prefix", c.prefix, "--node", "1", "down"])
            assert "host 1's link is down" in capsys.readouterr().out and not c.link_up(1) and c.link_up(0)
            assert reach(h0) == "TimeoutError" and reach(h1) == "reached"
            main(["cluster", "link", "--prefix", c.prefix, "--node", "1", "up"])
            assert c.link_up(1) and reach(h0, 10.0) == "reached"
            with pytest.raises(ValueError, match="no host 2 in this cluster of 2"):
                c.set_link(2, up=False)
        finally:
            server.kill()
            server.wait()
    finally:
        c.down()
    _gone(c)
