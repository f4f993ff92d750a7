"""The state of one ring link (parallel/ring.py) and what one poll of the ring found."""
from __future__ import annotations

import socket
from dataclasses import dataclass, field


@dataclass
class Polled:
    dead: dict[int, str] = field(default_factory=dict)   # neighbours with evidence or a timeout against them
    told: dict[int, str] = field(default_factory=dict)   # losses a neighbour passed on
    store_closed: bool = False                           # the store's process closed our connection


@dataclass
class Link:
    rank: int
    last_heard: float                 # monotonic time of the last line from it (or of our start)
    sock: socket.socket | None = None
    ident: str = ""
    inbuf: bytes = b""
    outbuf: bytearray = field(default_factory=bytearray)
    watched: bool = True              # False once it said goodbye ("d") or was judged lost
    eof_ok: bool = False              # its connection may close without blame: it said goodbye, or
                                      # passed on a loss ("l") and exits over it (policy "exit")
    beats_received: int = 0
