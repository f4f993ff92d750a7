"""Communication off the compute thread, and a simulated network link for testing overlap.

CommStream: one worker thread that runs submitted collectives in order, over a process group only
it uses, so every rank issues that group's collectives in the same order (the CPU analogue of a
CUDA communication stream). torch.distributed calls release the GIL, so the compute thread keeps
running while a transfer is in flight.

SimulatedLink: a testing tool. Each all-to-all through it takes at least latency + bytes / bandwidth
of wall time, counted from when the transfer starts, as over a real inter-node link: the delay
overlaps with whatever the caller computes before it waits (it is never a sleep on the compute
thread while the transfer could be in flight). Enabled by ParallelConfig.simulated_latency_us /
simulated_gbps; off (zero cost) by default.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class SimulatedLink:
    def __init__(self, latency_us: float = 0.0, gbps: float = 0.0):
        if latency_us < 0 or gbps < 0:
            raise ValueError(f"simulated link needs latency_us >= 0 and gbps >= 0, got {latency_us}, {gbps}")
        self.latency_s, self.gbps = latency_us * 1e-6, gbps

    @property
    def enabled(self) -> bool:
        return self.latency_s > 0 or self.gbps > 0

    def transfer_s(self, nbytes: int) -> float:
        """Seconds one transfer of nbytes (sent to other ranks) takes on this link."""
        bw = nbytes * 8 / (self.gbps * 1e9) if self.gbps > 0 else 0.0
        return self.latency_s + bw

    def ready_at(self, nbytes: int) -> float:
        """perf_counter() time at which a transfer started now is delivered."""
        return time.perf_counter() + self.transfer_s(nbytes)

    @staticmethod
    def wait_until(t: float) -> None:
        left = t - time.perf_counter()
        if left > 0:
            time.sleep(left)


class CommStream:
    """Runs fn() calls one at a time, in submission order, on its own thread."""

    def __init__(self, name: str = "wideep-comm"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], Any]) -> Future:
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class FutureWork:
    """Adapts a Future to the .wait() of torch's Work handles (what Pending expects)."""

    def __init__(self, fut: Future):
        self.fut = fut

    def wait(self) -> Any:
        return self.fut.result()
