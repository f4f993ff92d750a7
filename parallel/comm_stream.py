"""Communication off the compute thread, and a simulated network link for testing overlap.

CommStream: one worker thread that runs submitted collectives in order, over a process group only
it uses, so every rank issues that group's collectives in the same order. torch.distributed calls
release the GIL, so the compute thread keeps running while a transfer is in flight. On a CUDA
device the thread also owns a CUDA stream: work submitted after the compute stream's current
point (an event) runs on that stream, NCCL kernels included, and the compute stream waits for it
(another event) only in wait(). The host syncs a dispatch needs (receive counts) block the
communication thread, never the thread that launches the other microbatch's kernels.

SimulatedLink: a testing tool. Each all-to-all through it is delivered latency + bytes / bandwidth
after the collective's rendezvous (the moment the last rank posted its part: on a real link nothing
can arrive before its sender sent it), as over a real inter-node link. The delay overlaps with
whatever the caller computes before it waits (it is never a sleep on the compute thread while the
transfer could be in flight), and a rank that waits for a late peer still pays the full latency
after the peer arrives. The loopback exchange itself finishes at the rendezvous, so its completion
time stands in for it. Meant for gloo on CPU (completion callbacks of CUDA collectives fire when
the kernels are queued, not done).

SimulatedNetwork: one rank's two tiers of links, to the ranks of its own node (intra, NVLink-like)
and to other nodes (inter, RDMA-like), each a SimulatedLink with its own latency, bandwidth and
queue. A transfer says how many bytes it puts on each tier it uses (None: it talks to no rank on
that tier); it arrives when the slower tier has delivered (the tiers run in parallel, as NVLink and
RDMA do). Built from `[parallel] simulated_latency_us` / `simulated_gbps` (the intra-node tier; with
one node, every all-to-all) and `simulated_inter_node_latency_us` / `simulated_inter_node_gbps`
(0 = as the intra-node tier); off (zero cost) by default.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch


class SimulatedLink:
    """One rank's outgoing link. Its bandwidth is shared: transfers that overlap in time (two DBO
    microbatches, say) queue for it, so splitting a step cannot invent bandwidth; the latency of
    each transfer overlaps with the others' (pipelined)."""

    def __init__(self, latency_us: float = 0.0, gbps: float = 0.0):
        if latency_us < 0 or gbps < 0:
            raise ValueError(f"simulated link needs latency_us >= 0 and gbps >= 0, got {latency_us}, {gbps}")
        self.latency_s, self.gbps = latency_us * 1e-6, gbps
        self._lock = threading.Lock()
        self._free_at = 0.0    # perf_counter() time the link finishes what it has been given

    @property
    def enabled(self) -> bool:
        return self.latency_s > 0 or self.gbps > 0

    def transfer_s(self, nbytes: int) -> float:
        """Seconds one transfer of nbytes (sent to other ranks) takes on an idle link."""
        return self.latency_s + self._wire_s(nbytes)

    def _wire_s(self, nbytes: int) -> float:
        return nbytes * 8 / (self.gbps * 1e9) if self.gbps > 0 else 0.0

    def deliver_at(self, t_rendezvous: float, nbytes: int) -> float:
        """perf_counter() time at which a transfer whose rendezvous was at t_rendezvous arrives:
        it gets the wire once earlier transfers are through, then pays the latency."""
        with self._lock:
            start = max(t_rendezvous, self._free_at)
            self._free_at = start + self._wire_s(nbytes)
            return self._free_at + self.latency_s

    @staticmethod
    def wait_until(t: float) -> None:
        left = t - time.perf_counter()
        if left > 0:
            time.sleep(left)


class SimulatedNetwork:
    """intra: the link to the other ranks of this node; inter: to ranks of other nodes (None: the
    same link object carries both tiers, sharing one bandwidth, as a plain SimulatedLink did)."""

    def __init__(self, intra: SimulatedLink, inter: SimulatedLink | None = None):
        self.intra, self.inter = intra, inter if inter is not None else intra
        self.delay_s = 0.0     # sum over transfers of (arrival - rendezvous): what the links added

    @classmethod
    def of(cls, link: "SimulatedLink | SimulatedNetwork | None") -> "SimulatedNetwork | None":
        """A network from a link (one tier for everything) or a network; None when off."""
        net = cls(link) if isinstance(link, SimulatedLink) else link
        return net if net is not None and net.enabled else None

    @classmethod
    def from_config(cls, pcfg) -> "SimulatedNetwork | None":
        """From a ParallelConfig's simulated_* fields; None when every one is 0."""
        intra = SimulatedLink(pcfg.simulated_latency_us, pcfg.simulated_gbps)
        inter = SimulatedLink(pcfg.simulated_inter_node_latency_us or pcfg.simulated_latency_us,
                              pcfg.simulated_inter_node_gbps or pcfg.simulated_gbps)
        return cls.of(cls(intra, inter))

    @property
    def enabled(self) -> bool:
        return self.intra.enabled or self.inter.enabled

    def transfer_s(self, intra: int | None, inter: int | None) -> float:
        """Seconds a transfer with these bytes per tier (None: tier unused) takes on idle links."""
        return max([0.0] + [link.transfer_s(n) for link, n in self._legs(intra, inter)])

    def deliver_at(self, t_rendezvous: float, intra: int | None, inter: int | None) -> float:
        """Arrival of a transfer whose rendezvous was at t_rendezvous: each tier it uses delivers
        its bytes (queued behind that tier's earlier transfers); the slower tier decides."""
        arrival = max([t_rendezvous] + [link.deliver_at(t_rendezvous, n) for link, n in self._legs(intra, inter)])
        self.delay_s += arrival - t_rendezvous
        return arrival

    def ready_at(self, intra: int | None, inter: int | None) -> float:
        """Arrival of a transfer whose rendezvous is now (right after a blocking collective)."""
        return self.deliver_at(time.perf_counter(), intra, inter)

    def track(self, works: list, intra: int | None, inter: int | None) -> Callable[[], None]:
        """For async collectives: -> a function that, called after the works were waited, blocks
        until the transfer arrives, counted from when the last of them completed (timestamped by
        completion callbacks, so compute done between start and wait hides the delay)."""
        done: list[float] = []
        for w in works:
            w.get_future().then(lambda _f: done.append(time.perf_counter()))

        def deliver() -> None:
            # the callbacks run when each work completes; a work without one yet finished just now
            t = max(done) if len(done) == len(works) else time.perf_counter()
            SimulatedLink.wait_until(self.deliver_at(t, intra, inter))
        return deliver

    def _legs(self, intra: int | None, inter: int | None) -> list[tuple[SimulatedLink, int]]:
        if self.inter is self.intra:   # one link for both tiers: one transfer of all the bytes
            used = [n for n in (intra, inter) if n is not None]
            return [(self.intra, sum(used))] if used else []
        return [(link, n) for link, n in ((self.intra, intra), (self.inter, inter)) if n is not None]


class CommStream:
    """Runs fn() calls one at a time, in submission order, on its own thread (and its own CUDA
    stream when device is a CUDA device)."""

    def __init__(self, name: str = "wideep-comm", device: torch.device | str | None = None):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        device = torch.device(device) if device is not None else None
        self.cuda_stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    def submit(self, fn: Callable[[], Any], keep: tuple = ()) -> "StreamWork":
        """Run fn() after everything already queued here. keep: the caller's tensors fn reads; on
        CUDA they are marked in use by the communication stream so the allocator cannot hand their
        memory to the compute stream while a transfer still reads it."""
        if self.cuda_stream is None:
            return StreamWork(self._pool.submit(fn))
        start = torch.cuda.Event()
        start.record()                                   # the compute stream's current point
        comm = self.cuda_stream
        for t in keep:
            t.record_stream(comm)

        def run():
            with torch.cuda.stream(comm):
                comm.wait_event(start)
                out = fn()
                done = torch.cuda.Event()
                done.record(comm)
            return out, done
        return StreamWork(self._pool.submit(run), cuda=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamWork:
    """A submitted fn's result, with the .wait() of torch's Work handles (what Pending expects).
    wait() blocks until fn has returned; on CUDA the caller's stream then waits for fn's kernels,
    and the tensors it returns are marked in use by the caller's stream."""

    def __init__(self, fut: Future, cuda: bool = False):
        self.fut, self.cuda = fut, cuda
        self._done, self._result = False, None

    def wait(self) -> Any:
        if not self._done:
            out = self.fut.result()
            if self.cuda:
                out, done = out
                stream = torch.cuda.current_stream()
                stream.wait_event(done)
                for t in _tensors(out):
                    t.record_stream(stream)
            self._result, self._done = out, True
        return self._result


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in _tensors(getattr(obj, name))]
    return []
