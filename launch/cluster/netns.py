"""The `ip` and `tc` calls of the cluster harness, and the one check of whether this process may make them.

Every call names the namespace or link it touches; nothing here lists or edits a link by pattern.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess


class ClusterUnavailable(RuntimeError):
    """This process cannot make network namespaces (not root, no `ip`, or the kernel refuses): one line."""


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def rate_bits(rate: str) -> int:
    """tc's rate spelling ("5gbit", "100mbit", "2.5gbit") -> bits per second; ValueError otherwise."""
    m = _RATE.match(rate.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate must be a positive number with a unit bit|kbit|mbit|gbit|tbit "
                         f"(tc's spelling, e.g. 5gbit), got {rate!r}")
    return int(float(m.group(1)) * _UNIT[m.group(2)])


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One `ip`/`tc` command; a failure raises RuntimeError with the command and its stderr."""
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and p.returncode:
        raise RuntimeError(f"`{' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def require_privilege() -> None:
    """ClusterUnavailable (one line) unless this process can make namespaces: root, `ip` and `tc`."""
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"wideep cluster needs root to make network namespaces (running as uid "
                                 f"{os.geteuid()})")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ClusterUnavailable(f"wideep cluster needs iproute2's {' and '.join(missing)} on PATH")


def add_namespace(name: str) -> None:
    """`ip netns add name`, where the kernel's refusal (a container without CAP_SYS_ADMIN) is ClusterUnavailable."""
    p = run("ip", "netns", "add", name, check=False)
    if p.returncode:
        raise ClusterUnavailable(f"wideep cluster: `ip netns add {name}` failed: {p.stderr.strip()}")


def namespaces() -> set[str]:
    """Names of the namespaces `ip netns` knows."""
    out = run("ip", "netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str, netns: str | None = None) -> bool:
    where = ("-n", netns) if netns else ()
    return run("ip", *where, "link", "show", "dev", name, check=False).returncode == 0


def shape(netns: str, dev: str, rate: str) -> None:
    """Egress of dev in netns limited to `rate` by a token bucket (tbf). The bucket holds at least
    one 64 KiB GSO packet (a smaller one drops them) and ~2 ms at the rate; the queue holds 100 ms
    at the rate, so bursts of a collective wait rather than drop (a drop would add retransmitted
    bytes to the wire's count)."""
    bps = rate_bits(rate)
    burst = max(256 * 1024, bps // 8 // 500)
    run("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
        "burst", str(burst), "latency", "100ms")


def pids(netns: str) -> list[int]:
    """Processes inside netns (`ip netns pids`)."""
    p = run("ip", "netns", "pids", netns, check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []
