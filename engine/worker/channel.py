"""The asynchronous control channel between the front and the ranks: ZeroMQ over TCP.

    front:  FrontChannel.send(rank, msg)   -> that rank's inbox (one PUSH socket per rank it serves)
            FrontChannel.recv(timeout_s)   <- Reports of every rank (one PULL socket)
    rank:   RankChannel.recv(timeout_s)    <- its inbox (one PULL socket)
            RankChannel.report(report)     -> the front (one PUSH socket)

Why ZeroMQ rather than torch.distributed objects: requests and outputs must flow without any rank
waiting for another (an object broadcast or gather is a collective: every rank would wait for the
slowest, the front included), and the rendezvous store is no place for payloads. ZeroMQ queues
messages in the sender's background I/O thread, so a rank never blocks on a slow front.

Addresses go through the rendezvous store once at start-up: each rank publishes its inbox, the front
its report socket (two store operations per rank, whatever the world size), under keys named by the
channel's name (agree_name: rank 0 draws it, the others hear it). Every endpoint binds the address
this host uses to reach the store's host (127.0.0.1 on one machine), never all interfaces.
local_pair() is the single-process stand-in (plain deques, no sockets).
"""
from __future__ import annotations

import pickle
import socket
import uuid
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from wideep.parallel.watchdog import guard_collective


def agree_name(ctx) -> str:
    """A fresh name for one engine's channel, the same on every rank of ctx (collective over its CPU
    group, once per engine at start-up): rank 0 draws it, the others receive it. Drawn rather than
    counted, so two engines in one process, or a run restarted against a store that outlived the
    last attempt (torchrun's agent store), never read each other's addresses."""
    name = torch.empty(16, dtype=torch.uint8)
    if ctx.rank == 0:
        name.copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
    with guard_collective(ctx):
        dist.broadcast(name, src=0, group=ctx.cpu_group)
    return bytes(name.tolist()).hex()


def _reachable_ip(store_host: str | None) -> str:
    """The local address used to reach the store's host (so peers on other hosts can connect)."""
    if not store_host or store_host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        ip = socket.gethostbyname(store_host)
        if ip.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _zmq():
    import zmq
    return zmq


class _Endpoints:
    """Store keys of one engine's channel: inbox/<rank> and front."""

    def __init__(self, ctx, name: str):
        self.store = ctx.store
        self.prefix = f"wideep/chan/{name}/"
        host = getattr(self.store, "host", None)
        self.ip = _reachable_ip(host)
        self.timeout = timedelta(seconds=ctx.timeout_s)

    def publish(self, key: str, addr: str) -> None:
        self.store.set(self.prefix + key, addr.encode())

    def lookup(self, keys: list[str]) -> list[str]:
        full = [self.prefix + k for k in keys]
        self.store.wait(full, self.timeout)
        return [v.decode() for v in self.store.multi_get(full)]


def _bind_pull(zmq, zctx, ip: str):
    sock = zctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{ip}")
    return sock, f"tcp://{ip}:{port}"


def _connect_push(zmq, zctx, addr: str):
    sock = zctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)   # let queued messages out at close, but never hang on a dead peer
    sock.setsockopt(zmq.SNDHWM, 0)      # never block the sender: the receiver drains at its own pace
    sock.connect(addr)
    return sock


def _recv_all(zmq, sock, timeout_s: float | None) -> list:
    """Whatever is queued; when nothing is, wait up to timeout_s (None: forever, 0: not at all)."""
    out = []
    while True:
        try:
            out.append(pickle.loads(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            break
    if out or timeout_s == 0:
        return out
    if sock.poll(None if timeout_s is None else int(timeout_s * 1000)):
        return _recv_all(zmq, sock, 0)
    return out


class FrontChannel:
    """ranks: the global ranks this front sends to (every rank of the job)."""

    def __init__(self, ctx, ranks: list[int], name: str):
        zmq = self.zmq = _zmq()
        self.zctx = zmq.Context.instance()
        ep = _Endpoints(ctx, name)
        self.pull, addr = _bind_pull(zmq, self.zctx, ep.ip)
        ep.publish("front", addr)
        addrs = ep.lookup([f"inbox/{r}" for r in ranks])
        self.push = {r: _connect_push(zmq, self.zctx, a) for r, a in zip(ranks, addrs)}
        self.sent_bytes = 0
        self._ep = ep

    @property
    def store(self):
        """The rendezvous store (a grow's front reads its new ranks' readiness there)."""
        return self._ep.store

    def send(self, rank: int, msg) -> None:
        data = pickle.dumps(msg)
        self.sent_bytes += len(data)
        self.push[rank].send(data)

    def broadcast(self, ranks, msg) -> None:
        data = pickle.dumps(msg)
        for r in ranks:
            self.sent_bytes += len(data)
            self.push[r].send(data)

    def recv(self, timeout_s: float | None) -> list:
        return _recv_all(self.zmq, self.pull, timeout_s)

    def add(self, ranks: list[int]) -> None:
        """Ranks that joined (a resize that grows): connect to their inboxes (published before they reported)."""
        addrs = self._ep.lookup([f"inbox/{r}" for r in ranks])
        for r, a in zip(ranks, addrs):
            self.push[r] = _connect_push(self.zmq, self.zctx, a)

    def drop(self, rank: int) -> None:
        """A rank that left (a resize): its inbox is closed for good."""
        sock = self.push.pop(rank, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for s in self.push.values():
            s.close()
        self.pull.close()


class RankChannel:
    def __init__(self, ctx, name: str):
        zmq = self.zmq = _zmq()
        self.zctx = zmq.Context.instance()
        ep = _Endpoints(ctx, name)
        self.pull, addr = _bind_pull(zmq, self.zctx, ep.ip)
        ep.publish(f"inbox/{ctx.origin_rank}", addr)   # the front addresses ranks by origin rank
        self._ep = ep
        self._push = None
        self.sent_bytes = 0

    def _front(self):
        if self._push is None:  # the front publishes once it has bound; look it up on first use
            self._push = _connect_push(self.zmq, self.zctx, self._ep.lookup(["front"])[0])
        return self._push

    def recv(self, timeout_s: float | None) -> list:
        return _recv_all(self.zmq, self.pull, timeout_s)

    def report(self, report) -> None:
        data = pickle.dumps(report)
        self.sent_bytes += len(data)
        self._front().send(data)

    def close(self) -> None:
        if self._push is not None:
            self._push.close()
        self.pull.close()


class _LocalEnd:
    def __init__(self, inbound: deque, outbound: deque):
        self._in, self._out = inbound, outbound
        self.sent_bytes = 0

    def recv(self, timeout_s: float | None) -> list:
        out = list(self._in)
        self._in.clear()
        return out

    def _put(self, msg) -> None:
        self._out.append(msg)

    def has_messages(self) -> bool:
        return bool(self._in)

    def drop(self, rank: int) -> None:
        pass   # one process: nobody leaves

    send = lambda self, rank, msg: self._put(msg)              # noqa: E731 (front end)
    broadcast = lambda self, ranks, msg: self._put(msg)        # noqa: E731 (front end)
    report = _put                                              # (rank end)

    def close(self) -> None:
        pass


def local_pair() -> tuple[_LocalEnd, _LocalEnd]:
    """One process, no sockets: (the front's end, the rank's end) over two in-process queues."""
    inbox, reports = deque(), deque()
    return _LocalEnd(reports, inbox), _LocalEnd(inbox, reports)
