"""KVTransfer: point-to-point moves of latent-KV rows between a prefill and a decode rank.

Two methods, each the start half of a start/wait pair:
    h = kv.send_start(dst, stream, tensor)     # dst: global rank; stream: a transfer's id
    h = kv.recv_start(src, stream, out)        # fills `out` (preallocated, same shape and dtype)
    h.done() -> bool (polls, never blocks)      h.wait() (blocks; raises RankLostError for a dead peer)
Messages of one (src, dst, stream) arrive in the order they were sent; different streams are
independent. A send completes only once the receiver has posted the matching receive: a decode rank
that has no blocks yet (and so posts nothing) makes the sender's transfer wait — the back-pressure.

Backends:
- "torch" (TorchKVTransfer): torch.distributed isend/irecv over a dedicated gloo process group,
  stream id as the tag (the tested path). Device tensors are staged through host memory: NCCL
  ignores tags and matches a pair's messages in posting order, which concurrent transfers between
  the same two ranks (each received by its own thread) do not keep; a direct NCCL path would have to
  order them per pair (not written; untested on GPU).
- "nixl" / "mooncake": the seam for RDMA/NVLink engines (NIXL, Mooncake Transfer Engine). They are
  one-sided (register the pools, write remote memory), so an adapter would post a write in
  send_start and poll a notification in done(); no adapter is written yet, and asking for one says
  so, naming the package it would need.
"""
from __future__ import annotations

import importlib.util
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from wideep.parallel.watchdog import guard_collective

_NO_DEADLINE = timedelta(days=1)
_OPTIONAL = {"nixl": "nixl", "mooncake": "mooncake.engine"}


class Handle:
    """One send or receive in flight. done() polls a flag that a waiter thread sets (gloo's p2p works
    report completion only through a blocking wait(), so a thread per stream does that wait)."""

    def __init__(self, ctx, work, keep: torch.Tensor, then=None):
        self._ctx, self._work, self._keep = ctx, work, keep  # keep: the buffer lives until done
        self._then = then  # runs once the message is in (a received host copy -> the device)
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.finished_at: float | None = None

    def _complete(self) -> None:  # the waiter thread
        try:
            # no deadline: a send may wait as long as its decode rank has no blocks (back-pressure);
            # a dead peer fails the wait (gloo) or is named by the watchdog, which ends the process
            self._work.wait(_NO_DEADLINE)
            if self._then is not None:
                self._then()
        except BaseException as e:  # a dead peer: raised in the caller's thread by done()/wait()
            self._error = e
        self.finished_at = time.perf_counter()
        self._work = None
        self._event.set()

    def done(self) -> bool:
        if not self._event.is_set():
            return False
        if self._error is not None:
            with guard_collective(self._ctx):
                raise self._error
        return True

    def wait(self) -> None:
        self._event.wait()
        self.done()


class _Waiters:
    """One daemon thread per (peer, stream) with messages in flight, waiting for them in posting
    order (the order they complete in); it exits when its stream has nothing left in flight."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int], deque] = {}

    def add(self, key: tuple[int, int], h: Handle) -> None:
        with self._lock:
            q = self._queues.get(key)
            start = q is None
            if start:
                q = self._queues[key] = deque()
            q.append(h)
        if start:
            threading.Thread(target=self._drain, args=(key,), daemon=True, name=f"kv-wait-{key}").start()

    def _drain(self, key) -> None:
        while True:
            with self._lock:
                q = self._queues[key]
                if not q:
                    del self._queues[key]
                    return
                h = q[0]
            h._complete()
            with self._lock:
                q.popleft()


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    sends: int = 0
    recvs: int = 0
    per_peer_bytes: dict = field(default_factory=dict)  # peer global rank -> bytes sent + received


class TorchKVTransfer:
    """group: a gloo process group over all ranks used only for these messages (its own connections,
    so a send waiting for its receiver never holds up a pool's collectives)."""

    def __init__(self, ctx, group):
        self.ctx, self.group = ctx, group
        self.stats = TransferStats()
        self._waiters = _Waiters()

    def _count(self, peer: int, n: int, sent: bool) -> None:
        s = self.stats
        if sent:
            s.bytes_sent, s.sends = s.bytes_sent + n, s.sends + 1
        else:
            s.bytes_received, s.recvs = s.bytes_received + n, s.recvs + 1
        s.per_peer_bytes[peer] = s.per_peer_bytes.get(peer, 0) + n

    def send_start(self, dst: int, stream: int, tensor: torch.Tensor) -> Handle:
        # SYNC: a device tensor is staged on the host (waits for the layer that wrote it; see the module doc)
        t = tensor.contiguous() if tensor.device.type == "cpu" else tensor.to("cpu")
        with guard_collective(self.ctx):
            work = dist.isend(t, dst, group=self.group, tag=stream)
        self._count(dst, t.numel() * t.element_size(), True)
        h = Handle(self.ctx, work, t)
        self._waiters.add((dst, stream), h)
        return h

    def recv_start(self, src: int, stream: int, out: torch.Tensor) -> Handle:
        if not out.is_contiguous():
            raise ValueError(f"recv_start needs a contiguous buffer, got strides {out.stride()}")
        host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        with guard_collective(self.ctx):
            work = dist.irecv(host, src, group=self.group, tag=stream)
        self._count(src, out.numel() * out.element_size(), False)
        h = Handle(self.ctx, work, host, None if host is out else (lambda: out.copy_(host)))
        self._waiters.add((src, stream), h)
        return h


def check_backend(backend: str) -> None:
    """Raise unless `backend` can be built here (called on every rank before connecting)."""
    if backend == "torch":
        return
    module = _OPTIONAL.get(backend)
    if module is None:
        raise ValueError(f"kv_transfer backend must be one of {['torch', *_OPTIONAL]}, got {backend!r}")
    have = importlib.util.find_spec(module.split(".")[0]) is not None
    raise RuntimeError(f"kv_transfer backend {backend!r}: no adapter is written yet (the package {module!r} is "
                       f"{'installed' if have else 'not installed'}); use 'torch', or implement send_start/"
                       f"recv_start over it (disagg/kv_transfer.py)")


def make_kv_transfer(backend: str, ctx, group) -> TorchKVTransfer:
    check_backend(backend)
    return TorchKVTransfer(ctx, group)


# -- small objects (headers, first tokens) over the same channel: a length, then the bytes ------------
def recv_object(kv: TorchKVTransfer, src: int, stream: int):
    """Blocking: the next pickled object of (src, stream)."""
    n = torch.zeros(1, dtype=torch.int64)
    kv.recv_start(src, stream, n).wait()
    body = torch.empty(int(n.item()), dtype=torch.uint8)  # SYNC: a host tensor, its length sizes the next one
    kv.recv_start(src, stream, body).wait()
    return pickle.loads(body.numpy().tobytes())


def send_object(kv: TorchKVTransfer, dst: int, stream: int, obj) -> list[Handle]:
    body = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return [kv.send_start(dst, stream, torch.tensor([body.numel()], dtype=torch.int64)),
            kv.send_start(dst, stream, body)]
