"""Heartbeat links between ring neighbours: how one rank tells a dead neighbour from a slow one.

Rank r keeps one plain TCP connection to its successor (r+1) % W, which it opens, and one to its
predecessor (r-1) % W, which it accepts: two sockets and two beats per heartbeat_s per rank at
any world size, and no rendezvous-store traffic in steady state.

Evidence of death, acted on at once:
- the connection closes (EOF or reset) without a goodbye: the OS closes a process's sockets when
  it dies, whatever killed it (SIGKILL, OOM killer, a segfault);
- a connect to the neighbour's published port is refused: nothing listens there any more;
- on the same host (same kernel and pid namespace), the neighbour's process is gone or a zombie:
  covers a socket that outlives its process.
Silence is slowness until it has lasted timeout_s: a rank stopped (SIGSTOP), starved of CPU or
holding the GIL in a long call is not lost before that. Time this rank itself did not run (its
own loop overslept) is not counted against its neighbours.

Lines on a link: "h <rank> <world> <ident>" hello (opener first), "b" beat, "d" leaving on
purpose, "l <json {rank: reason}>" these ranks are lost (every rank forwards what it newly learns,
so a verdict also travels when the rendezvous store is gone).
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
import weakref

from .process import process_gone, process_ident  # noqa: F401 (process_ident: the hello line's)
from .ring_link import Link, Polled

_LIVE: "weakref.WeakSet[Ring]" = weakref.WeakSet()


def _close_inherited() -> None:
    # A forked child (a dataloader or compile worker) would keep the ring sockets open after this
    # process dies, and its neighbours would see no EOF; the child never speaks on them anyway.
    for ring in list(_LIVE):
        ring.close_fds_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


class Ring:
    """One rank's links to its ring neighbours. poll() is called by one thread (the watchdog's);
    send_lost/send_goodbye may be called from any thread."""

    def __init__(self, rank: int, world_size: int, heartbeat_s: float, timeout_s: float, host: str = "127.0.0.1",
                 advertise: str | None = None):
        if world_size < 2:
            raise ValueError(f"a ring needs at least 2 ranks, got world_size {world_size}")
        self.rank, self.world_size, self.heartbeat_s, self.timeout_s = rank, world_size, heartbeat_s, timeout_s
        self.ident = process_ident()
        self.succ, self.pred = (rank + 1) % world_size, (rank - 1) % world_size
        # With two ranks both neighbours are the same rank: one connection, opened by rank 0.
        self.opens = not (world_size == 2 and rank == 1)
        self.accepts = not (world_size == 2 and rank == 0)
        now = time.monotonic()
        self.links = {r: Link(r, now) for r in {self.succ, self.pred}}
        self._succ_addr: tuple[str, int] | None = None
        self._next_connect = 0.0
        self._lock = threading.Lock()          # outbufs and sockets, shared with senders
        self._sel = selectors.DefaultSelector()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, 0), family=family, backlog=8)
        self.advertise = advertise or self.listener.getsockname()[0]
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ, "accept")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._hello_pending: dict[socket.socket, bytes] = {}
        self._store_sock: socket.socket | None = None
        self._last_beat = now
        self._last_clock = now                 # poll()'s last clock read: time since then was not ours
        self.beats_sent = 0
        self._closed = False
        _LIVE.add(self)

    @property
    def record(self) -> str:
        """What the neighbours need to reach and identify this rank ("host port ident")."""
        return f"{self.advertise} {self.listener.getsockname()[1]} {self.ident}"

    # -- connections -------------------------------------------------------------------------------
    def set_successor(self, record: str) -> None:
        """The successor's published record: the thread running poll() connects to it next."""
        if not self.opens:
            return
        host, port, *ident = record.split(" ")
        with self._lock:
            self.links[self.succ].ident = ident[0] if ident else ""
            self._succ_addr = (host, int(port))
        self.wake()

    def _try_connect(self, now: float) -> dict[int, str]:
        link = self.links[self.succ]
        self._next_connect = now + self.heartbeat_s
        try:
            sock = socket.create_connection(self._succ_addr, timeout=min(self.heartbeat_s, 2.0))
        except ConnectionRefusedError:
            return {self.succ: f"rank {self.rank} found its published port {self._succ_addr[1]} closed: "
                               f"the process is gone"}
        except OSError:  # unreachable or slow: silence, judged by the timeout
            return {}
        self._adopt_socket(link, sock, now)
        self._send(link, f"h {self.rank} {self.world_size} {self.ident}\n".encode())
        return {}

    def _adopt_socket(self, link: Link, sock: socket.socket, now: float) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            link.sock, link.last_heard = sock, now
        self._sel.register(sock, selectors.EVENT_READ, link)

    def _accept(self, now: float) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        self._hello_pending[sock] = b""
        self._sel.register(sock, selectors.EVENT_READ, "hello")

    def _read_hello(self, sock: socket.socket, now: float, heard: dict) -> None:
        try:
            data = sock.recv(512)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        buf = self._hello_pending[sock] + data
        if b"\n" not in buf and data and len(buf) < 512:
            self._hello_pending[sock] = buf
            return
        del self._hello_pending[sock]
        self._sel.unregister(sock)
        line, _, rest = buf.partition(b"\n")
        parts = line.decode(errors="replace").split(" ")
        link = self.links[self.pred]
        if (not self.accepts or len(parts) < 3 or parts[0] != "h" or parts[1] != str(self.pred)
                or parts[2] != str(self.world_size) or link.sock is not None):
            sock.close()  # not our predecessor (a stray or stale connection): ignore it
            return
        link.ident = parts[3] if len(parts) > 3 else ""
        self._adopt_socket(link, sock, now)
        if rest:
            heard.update(self._receive(link, rest, now))

    # -- sending -----------------------------------------------------------------------------------
    def _send(self, link: Link, line: bytes) -> None:
        with self._lock:
            if link.sock is None:
                return
            link.outbuf += line
            try:
                sent = link.sock.send(link.outbuf)
                del link.outbuf[:sent]
            except BlockingIOError:
                pass   # the peer is not reading (stopped): keep it, flush later
            except OSError:
                pass   # closed: poll() sees the EOF and judges it

    def _send_all(self, line: bytes) -> None:
        for link in self.links.values():
            self._send(link, line)
        self.wake()

    def wake(self) -> None:
        """Make a poll() in progress return now."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def send_lost(self, lost: dict[int, str]) -> None:
        self._send_all(b"l " + json.dumps({str(r): why for r, why in lost.items()}).encode() + b"\n")

    def send_goodbye(self) -> None:
        self._send_all(b"d\n")

    # -- the loop body -----------------------------------------------------------------------------
    def poll(self, timeout: float) -> "Polled":
        """Wait up to timeout for traffic, beat when due, and judge the neighbours."""
        events = self._sel.select(timeout)
        now = time.monotonic()
        # Measured from the previous poll's clock read, not from this select's start: a stall that
        # hits this thread between two polls (the GIL held elsewhere while it is mid-loop) is as
        # unwitnessed as one that hits it inside select.
        overslept = now - self._last_clock - timeout
        self._last_clock = now
        if overslept > self.heartbeat_s:  # we did not run: nobody's silence grew meanwhile
            for link in self.links.values():
                link.last_heard += overslept
        out = Polled()
        for key, _ in events:
            if key.data == "accept":
                self._accept(now)
            elif key.data == "wake":
                self._wake_r.recv(4096)
            elif key.data == "hello":
                self._read_hello(key.fileobj, now, out.told)
            elif key.data == "store":
                out.store_closed = self._read_store()
            else:
                self._read(key.data, now, out.dead, out.told)
        succ = self.links[self.succ]
        if self._succ_addr and succ.sock is None and succ.watched and now >= self._next_connect:
            out.dead.update(self._try_connect(now))
        if now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            self._beat(now, out.dead)
        return out

    # -- the rendezvous store's process ------------------------------------------------------------
    def watch_store(self, addr: tuple[str, int]) -> None:
        """Hold an idle connection to the store's port: it closes when the process serving the
        store dies (a launcher that is not one of the ranks)."""
        sock = socket.create_connection(addr, timeout=10)
        sock.setblocking(False)
        self._store_sock = sock
        self._sel.register(sock, selectors.EVENT_READ, "store")

    def _read_store(self) -> bool:
        try:
            if self._store_sock.recv(4096):
                return False      # the store never writes unasked; ignore anything it does
        except BlockingIOError:
            return False
        except OSError:
            pass
        self._sel.unregister(self._store_sock)
        self._store_sock.close()
        self._store_sock = None
        return True

    def next_beat_in(self) -> float:
        return max(0.0, self._last_beat + self.heartbeat_s - time.monotonic())

    def _read(self, link: Link, now: float, dead: dict, heard: dict) -> None:
        try:
            data = link.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            heard.update(self._receive(link, data, now))
            return
        self._drop(link)
        if link.watched and not link.eof_ok:
            dead[link.rank] = (f"its connection to rank {self.rank} closed without a goodbye: "
                               f"the process is gone")
        link.watched = False

    def _receive(self, link: Link, data: bytes, now: float) -> dict[int, str]:
        link.last_heard = now
        link.inbuf += data
        *lines, link.inbuf = link.inbuf.split(b"\n")
        heard = {}
        for line in lines:
            if line == b"b":
                link.beats_received += 1
            elif line == b"d":
                link.watched, link.eof_ok = False, True
            elif line.startswith(b"l "):
                link.eof_ok = True
                heard.update({int(r): why for r, why in json.loads(line[2:]).items()})
        return heard

    def silences(self) -> dict[int, float]:
        """Seconds since each watched neighbour was last heard (any thread: it reads floats only)."""
        now = time.monotonic()
        return {link.rank: now - link.last_heard for link in list(self.links.values()) if link.watched}

    def _beat(self, now: float, dead: dict) -> None:
        for link in self.links.values():
            if link.sock is not None:
                self._send(link, b"b\n")
                self.beats_sent += 1
            if not link.watched:
                continue
            silent = now - link.last_heard
            if silent > 2 * self.heartbeat_s and process_gone(link.ident, self.ident):
                dead[link.rank] = (f"rank {self.rank} found its process (pid {link.ident.rsplit('/', 2)[1]}) gone "
                                   f"on their host")
            elif silent > self.timeout_s:
                dead[link.rank] = (f"no heartbeat for {silent:.1f} s (timeout {self.timeout_s:g} s), "
                                   f"seen by rank {self.rank}")

    def _drop(self, link: Link) -> None:
        with self._lock:
            if link.sock is None:
                return
            try:
                self._sel.unregister(link.sock)
            except (KeyError, ValueError):
                pass
            link.sock.close()
            link.sock = None

    def settled(self) -> bool:
        """Every neighbour still watched is connected (and introduced): a goodbye reaches them all."""
        return all(link.sock is not None for link in self.links.values() if link.watched)

    def stop_watching(self, rank: int) -> None:
        """A rank already judged lost: neither its silence nor its EOF is news any more."""
        link = self.links.get(rank)
        if link is not None:
            link.watched, link.eof_ok = False, True

    def flush(self, timeout_s: float) -> None:
        """Best effort: push queued lines (a goodbye) out before closing."""
        deadline = time.monotonic() + timeout_s
        for link in self.links.values():
            while link.outbuf and link.sock is not None and time.monotonic() < deadline:
                self._send(link, b"")
                time.sleep(0.005)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self.links.values():
            self._drop(link)
        for sock in list(self._hello_pending) + [self._store_sock]:
            if sock is not None:
                sock.close()
        self._hello_pending.clear()
        self._sel.close()
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()
        _LIVE.discard(self)

    def close_fds_in_child(self) -> None:
        for s in [l.sock for l in self.links.values()] + [self.listener, self._wake_r, self._wake_w, self._store_sock]:
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
