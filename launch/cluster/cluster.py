"""A local cluster: N network namespaces as hosts on one bridge, each host's link shaped with tbf.

    with Cluster.up(ClusterSpec(nodes=2, rate="5gbit")) as c:
        subprocess.run(c.hosts[1].argv(["torchrun", ...]))       # runs inside host 1
        c.link_bytes()                                           # [LinkBytes per host]
        c.set_link(1, up=False)                                  # a partition: host 1's cable pulled

Layout (prefix P, unique per cluster; X the cluster's /24 in 198.18.0.0/15):
  P-h{i}   host i: its loopback up (intra-host traffic), `eth0` at 198.18.X.{i+1}/24
  P-sw     the switch: bridge br0 with ports h{i} (each the other end of host i's eth0) and `root`
  P        in the root namespace, at 198.18.X.254/24: the other end of the switch's `root` port,
           so a client on this machine reaches the hosts (the HTTP front) through the bridge
The bridge lives in its own namespace, so the root namespace gains one link and nothing else;
hosts reach each other only through the switch, and nothing is routed or forwarded off the machine.

198.18.0.0/15 is reserved for network benchmarking (RFC 2544, RFC 6815): never routed on the
internet, and unlike 10/8 or 192.168/16 not what a developer's LAN, VPN or docker uses.

Each host's link is shaped in both directions at `rate` (tbf on eth0: what it sends; on its switch
port: what it receives), like a full-duplex NIC; `rate=None` leaves it unshaped. netem is absent
from this kernel: rate only, no delay.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field

# the modules, not the package: the package's __init__ imports this one
import wideep.launch.cluster.netns as netns
import wideep.launch.cluster.state as state
from .wire import LinkBytes

SWITCH_PORT_ROOT = "root"
HOST_DEV = "eth0"
_PREFIX = re.compile(r"^[a-z][a-z0-9]{1,7}$")
MAX_NODES = 200   # host addresses .1 .. .200 of the /24; .254 is the root end


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    rate: str | None = "5gbit"
    prefix: str = ""          # "" = drawn (unique per run)
    root_link: bool = True    # the root namespace's link into the switch (a client on this machine)

    def __post_init__(self):
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an integer in [1, {MAX_NODES}], got {self.nodes!r}")
        if self.rate is not None:
            netns.rate_bits(self.rate)
        if self.prefix and not _PREFIX.match(self.prefix):
            raise ValueError(f"prefix must be 2-8 characters [a-z0-9] starting with a letter (it names links of "
                             f"at most 15 characters), got {self.prefix!r}")


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    addr: str
    dev: str = HOST_DEV       # this host's end of its inter-host link (GLOO_SOCKET_IFNAME)
    port: str = ""            # the switch's end of it (in the switch namespace)

    def argv(self, argv: list[str]) -> list[str]:
        """argv run inside this host (`ip netns exec`, which also shows the host's own /sys/class/net)."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Cluster:
    prefix: str
    hosts: list[Host]
    switch: str
    root_dev: str | None
    root_addr: str | None
    rate: str | None
    owner_pid: int | None = None
    closed: bool = field(default=False, repr=False)

    # -- making and removing ------------------------------------------------------------------------
    @classmethod
    def up(cls, spec: ClusterSpec, owner_pid: int | None = None) -> "Cluster":
        """Make the cluster (module doc). owner_pid: the process whose exit makes the cluster stale
        (default this one; None for `wideep cluster up`, kept until `down`). Raises
        netns.ClusterUnavailable (one line) where namespaces cannot be made; on any failure
        removes what it made."""
        netns.require_privilege()
        with state.locked():
            recorded = state.all_states()
            prefix = spec.prefix or state.draw_prefix({s["prefix"] for s in recorded})
            if (any(s["prefix"] == prefix for s in recorded) or prefix + "-sw" in netns.namespaces()
                    or (spec.root_link and netns.link_exists(prefix))):
                raise ValueError(f"a cluster with prefix {prefix!r} exists already (wideep cluster down --prefix "
                                 f"{prefix})")
            x = _free_subnet({s["subnet"] for s in recorded})
            c = cls(prefix, [Host(i, f"{prefix}-h{i}", f"198.18.{x}.{i + 1}", port=f"h{i}") for i in range(spec.nodes)],
                    f"{prefix}-sw", prefix if spec.root_link else None, f"198.18.{x}.254" if spec.root_link else None,
                    spec.rate, owner_pid)
            state.save(c._state(x))    # before anything exists: a kill from here on leaves a `down` to run
        try:
            c._make()
        except BaseException:
            c.down()
            raise
        return c

    @classmethod
    def load(cls, prefix: str) -> "Cluster":
        s = state.load(prefix)
        hosts = [Host(**h) for h in s["hosts"]]
        return cls(s["prefix"], hosts, s["switch"], s["root_dev"], s["root_addr"], s["rate"], s["owner_pid"])

    def _state(self, subnet: int) -> dict:
        return {"prefix": self.prefix, "subnet": subnet, "switch": self.switch, "root_dev": self.root_dev,
                "root_addr": self.root_addr, "rate": self.rate, "owner_pid": self.owner_pid,
                "hosts": [h.__dict__ for h in self.hosts], "created": time.time()}

    def _make(self) -> None:
        sw, run = self.switch, netns.run
        for ns in [sw] + [h.netns for h in self.hosts]:
            netns.add_namespace(ns)
            # No IPv6: its neighbour discovery and MLD reports would be bytes on the wires that no rank sent.
            run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            run("ip", "link", "add", h.dev, "netns", h.netns, "type", "veth", "peer", "name", h.port, "netns", sw)
            run("ip", "-n", sw, "link", "set", h.port, "master", "br0", "up")
            run("ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
            run("ip", "-n", h.netns, "link", "set", h.dev, "up")
            if self.rate:
                netns.shape(h.netns, h.dev, self.rate)
                netns.shape(sw, h.port, self.rate)
        if self.root_dev:
            run("ip", "link", "add", self.root_dev, "type", "veth", "peer", "name", SWITCH_PORT_ROOT, "netns", sw)
            run("ip", "-n", sw, "link", "set", SWITCH_PORT_ROOT, "master", "br0", "up")
            # this link only: no IPv6 multicast from the machine's side flooded to every host's wire
            run("sysctl", "-q", "-w", f"net.ipv6.conf.{self.root_dev}.disable_ipv6=1")
            run("ip", "addr", "add", f"{self.root_addr}/24", "dev", self.root_dev)
            run("ip", "link", "set", self.root_dev, "up")

    def down(self) -> None:
        """Remove everything this cluster made: processes left inside its namespaces (SIGKILL, by
        pid), the root link, the namespaces (their links and qdiscs go with them), the state file.
        Idempotent; names that are already gone are skipped."""
        self.closed = True
        ours = [h.netns for h in self.hosts] + [self.switch]
        present = netns.namespaces()
        for ns in ours:
            if ns in present:
                for pid in netns.pids(ns):
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
        if self.root_dev and netns.link_exists(self.root_dev):
            netns.run("ip", "link", "del", self.root_dev)
        for ns in ours:
            if ns in present:
                netns.run("ip", "netns", "del", ns)
        state.remove(self.prefix)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # -- faults -------------------------------------------------------------------------------------
    def set_link(self, node: int, up: bool) -> None:
        """Host `node`'s link up or down at its switch port, like a pulled cable: the host's eth0 loses
        its carrier (its address and routes stay), what either side sends is dropped, and no
        connection is closed or refused: the ranks across it fall silent. down() needs nothing more
        (the port goes with the switch's namespace)."""
        if not 0 <= node < len(self.hosts):
            raise ValueError(f"no host {node} in this cluster of {len(self.hosts)}")
        netns.run("ip", "-n", self.switch, "link", "set", "dev", self.hosts[node].port, "up" if up else "down")

    def link_up(self, node: int) -> bool:
        """Whether host `node`'s switch port is up."""
        out = netns.run("ip", "-n", self.switch, "-j", "link", "show", "dev", self.hosts[node].port).stdout
        return "UP" in json.loads(out)[0]["flags"]

    # -- reading ------------------------------------------------------------------------------------
    def link_bytes(self) -> list[LinkBytes]:
        """Per host, the bytes its link carried since it was made, read at its switch port (the
        port receives what the host sends)."""
        return [LinkBytes.of_switch_port(self.switch, h.port) for h in self.hosts]

    def leftovers(self) -> list[str]:
        """Names of this cluster still present (namespaces, root link): [] after down()."""
        present = netns.namespaces()
        left = [ns for ns in [h.netns for h in self.hosts] + [self.switch] if ns in present]
        if self.root_dev and netns.link_exists(self.root_dev):
            left.append(self.root_dev)
        return left


def _free_subnet(taken: set[int]) -> int:
    """X of a 198.18.X.0/24 used by no recorded cluster and by no address or route of this machine."""
    used = netns.run("ip", "-4", "route", "show", "table", "all").stdout + netns.run("ip", "-4", "addr").stdout
    for x in range(1, 255):
        if x not in taken and f"198.18.{x}." not in used:
            return x
    raise RuntimeError("no free /24 in 198.18.0.0/16 for a cluster (254 in use): wideep cluster down")


def down_stale() -> list[str]:
    """`down` every recorded cluster whose owner process is gone (and every `wideep cluster up` one):
    -> their prefixes. A cluster whose owner still runs (a test in progress) is left alone."""
    gone = []
    for s in state.all_states():
        if not state.owner_alive(s):
            Cluster.load(s["prefix"]).down()
            gone.append(s["prefix"])
    return gone
