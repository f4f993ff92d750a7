"""Bytes on a link: read from the kernel's counters of one network device.

    LinkBytes.of_dev("eth0")                 this namespace's device (/sys/class/net/eth0/statistics)
    LinkBytes.of_switch_port("wd1a2b-sw", "h1")   host 1's link, read at its switch port
    after - before                           what crossed in between

The counters are the device's own: every frame, headers included (Ethernet, IP, TCP, and with
GSO one header per up-to-64 KiB super-frame), ACKs and retransmissions too.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import netns


@dataclass(frozen=True)
class LinkBytes:
    sent: int       # by the host (its device's tx)
    received: int   # by the host (its device's rx)

    @property
    def total(self) -> int:
        return self.sent + self.received

    def __sub__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.sent - other.sent, self.received - other.received)

    @classmethod
    def of_dev(cls, dev: str) -> "LinkBytes":
        """A device of this process's network namespace."""
        base = f"/sys/class/net/{dev}/statistics"
        if not os.path.isdir(base):
            raise ValueError(f"no network device {dev!r} here (no {base})")
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return cls(int(tx.read()), int(rx.read()))

    @classmethod
    def of_switch_port(cls, switch: str, port: str) -> "LinkBytes":
        """The host link whose switch end is `port` in namespace `switch`: what the port receives the
        host sent."""
        out = json.loads(netns.run("ip", "-n", switch, "-s", "-j", "link", "show", "dev", port).stdout)
        st = out[0]["stats64"]
        return cls(sent=st["rx"]["bytes"], received=st["tx"]["bytes"])


def wire_device() -> str | None:
    """The device gloo talks on when GLOO_SOCKET_IFNAME names one other than the loopback (the
    first of a comma-separated list), else None: on one host there is no wire to count."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    return dev if dev and dev != "lo" and os.path.isdir(f"/sys/class/net/{dev}") else None
