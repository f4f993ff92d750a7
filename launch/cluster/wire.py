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

from .netns import run as netns_run


# Ethernet (14) + IPv4 (20) + TCP with the timestamp option Linux sends by default (32): the bytes of
# every frame that are not TCP payload (ARP frames, 42 bytes, are the only others on these wires).
FRAME_HEADER_BYTES = 66


@dataclass(frozen=True)
class LinkBytes:
    sent: int                # bytes by the host (its device's tx), frame headers included
    received: int            # by the host (its device's rx)
    sent_frames: int = 0     # frames (a GSO super-frame counts once, as its header does)
    received_frames: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received

    @property
    def sent_payload(self) -> int:
        """TCP payload the host sent: its bytes less one header per frame (ACK-only frames are all header)."""
        return self.sent - FRAME_HEADER_BYTES * self.sent_frames

    def __sub__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.sent - other.sent, self.received - other.received,
                         self.sent_frames - other.sent_frames, self.received_frames - other.received_frames)

    @classmethod
    def of_dev(cls, dev: str) -> "LinkBytes":
        """A device of this process's network namespace."""
        base = f"/sys/class/net/{dev}/statistics"
        if not os.path.isdir(base):
            raise ValueError(f"no network device {dev!r} here (no {base})")
        got = []
        for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
            with open(f"{base}/{name}") as f:
                got.append(int(f.read()))
        return cls(*got)

    @classmethod
    def of_switch_port(cls, switch: str, port: str) -> "LinkBytes":
        """The host link whose switch end is `port` in namespace `switch`: what the port receives the
        host sent."""
        out = json.loads(netns_run("ip", "-n", switch, "-s", "-j", "link", "show", "dev", port).stdout)
        st = out[0]["stats64"]
        return cls(st["rx"]["bytes"], st["tx"]["bytes"], st["rx"]["packets"], st["tx"]["packets"])


def wire_device() -> str | None:
    """The device gloo talks on when GLOO_SOCKET_IFNAME names one other than the loopback (the
    first of a comma-separated list), else None: on one host there is no wire to count."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    return dev if dev and dev != "lo" and os.path.isdir(f"/sys/class/net/{dev}") else None
