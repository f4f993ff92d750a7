"""asyncio front for Engine (rank 0): one thread owns the Engine and steps it while there is work;
coroutines hand requests in and get RequestOutputs back through thread-safe queues.

    engine = Engine(model=dir, ...)          # every rank; ranks other than 0: engine.run_worker_loop()
    aengine = AsyncEngine(engine)            # rank 0: starts the engine thread
    async for out in aengine.generate([1, 2, 3], SamplingParams(max_tokens=8, output_kind="delta")):
        ...                                  # outputs as the engine makes them (cumulative | delta | final_only)
    await aengine.shutdown()                 # aborts what is in flight, then engine.shutdown() (releases workers)

Why a thread: step() is blocking compute and, multi-rank, blocking collectives; on the event loop it
would stall every connection for a whole step. Only the engine thread touches the Engine (commands go
through a SimpleQueue; outputs come back with loop.call_soon_threadsafe), so Engine needs no locks.
Errors of add_request reach the caller of generate() as the same exception; a consumer that stops
early (break, cancellation, client disconnect) aborts its request.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..sampling_params import RequestOutput, SamplingParams
from .engine import EngineDeadError
from .resize import ResizeFailed

# Latency buckets (s) for TTFT, TPOT, queue time and end-to-end latency: 1 ms .. 2 min.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Prometheus-style: counts[i] = observations <= BUCKETS[i] (cumulative at export), plus sum/count."""
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    sum: float = 0.0
    count: int = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(BUCKETS):
            if v <= b:
                self.counts[i] += 1
                break
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        """-> {"buckets": [(le, cumulative count)] ending with +Inf, "sum", "count"}."""
        cum = list(itertools.accumulate(self.counts))
        return {"buckets": list(zip(BUCKETS, cum)) + [(float("inf"), self.count)], "sum": self.sum,
                "count": self.count}


@dataclass
class RequestStats:
    """Cumulative over finished requests (the engine's own metrics keep only a window)."""
    finished: Counter = field(default_factory=Counter)  # finish_reason -> requests
    prompt_tokens: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)

    def record(self, m: dict, e2e_s: float) -> None:
        self.finished[m.get("finish_reason") or "unknown"] += 1
        self.prompt_tokens += m.get("prompt_tokens", 0)
        for name in ("ttft", "tpot", "queue"):
            v = m.get(f"{name}_s")
            if v is not None:
                getattr(self, name).observe(v)
        self.e2e.observe(e2e_s)

    def snapshot(self) -> dict:
        return {"requests_finished": dict(self.finished), "prompt_tokens_total": self.prompt_tokens,
                **{f"{n}_s": getattr(self, n).snapshot() for n in ("ttft", "tpot", "queue", "e2e")}}


@dataclass(eq=False)
class _Stream:
    """One generate() call: where its outputs go. Identity matters: an abort names the stream, so a
    rejected duplicate id can never abort the live request that owns the id."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    start: float = field(default_factory=time.monotonic)


class AsyncEngine:
    """keepalive_s: step an idle engine this often (default None: never). Not needed to keep worker
    ranks alive — they wait for the front on the engine's doorbell however long it idles — but
    available for stacks that want periodic empty steps (e.g. fresh per-rank stats)."""

    def __init__(self, engine, keepalive_s: float | None = None):
        if not engine.is_front:
            raise RuntimeError(f"AsyncEngine runs on rank 0; rank {engine.ctx.rank} calls engine.run_worker_loop()")
        self.engine = engine
        self.keepalive_s = keepalive_s
        self.stats = RequestStats()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}       # engine thread only
        self._stopping = False
        self._resize: asyncio.Future | None = None   # the running resize's caller
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wideep-engine", daemon=True)
        self._thread.start()

    # -- coroutine side -----------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread stopped by itself (step() raised), else None."""
        return self._dead

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs (per params.output_kind) until the finished one.
        Raises add_request's exception (ValueError for bad input) before yielding anything."""
        self._check_alive()
        rid = str(request_id) if request_id is not None else uuid.uuid4().hex
        spec = params.structured_outputs if isinstance(params, SamplingParams) else None
        if spec is not None:   # compiled off the engine thread, which then finds it in the cache
            await asyncio.wrap_future(self.engine.core.grammars.submit(spec))
        stream = _Stream(asyncio.get_running_loop())
        self._cmds.put(("add", rid, prompt, params, stream))
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True  # rejected, or the engine died: nothing of ours is left in it
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:  # break, cancellation, client disconnect: free the slot and its KV blocks
                self._cmds.put(("abort", rid, stream))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its generate() ends with finish_reason "abort".
        Unknown or already finished ids are ignored (the request may finish in the meantime)."""
        self._cmds.put(("abort", str(request_id), None))

    async def metrics(self) -> dict:
        """engine.metrics() (read on the engine thread, between steps) + cumulative RequestStats."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("metrics", fut))
        return await fut

    async def health(self) -> dict:
        """engine.health() (read on the engine thread, between steps): serving, status, lost ranks."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("health", fut))
        return await fut

    async def scale_elastic_ep(self, new_data_parallel_size) -> dict:
        """Resize to new_data_parallel_size ranks (Engine.start_resize; vLLM's AsyncLLM method of this name);
        returns the resize's figures once the new shape serves. Requests keep flowing meanwhile. Raises
        ResizeError / ResizeConflict (engine/front/resize.py) before anything changes."""
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("resize", new_data_parallel_size, fut))
        return await fut

    @property
    def is_resizing(self) -> bool:
        return self._resize is not None

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self, timeout_s: float | None = None) -> None:
        """Blocking shutdown: abort in-flight requests, report their aborts, engine.shutdown()."""
        self._cmds.put(("stop",))
        self._thread.join(timeout_s)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead!r}") from self._dead
        if not self.is_running:
            raise EngineDeadError("engine is shut down")

    # -- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stopping:
                idle = not eng.has_unfinished_requests() and self._resize is None
                woke = self._handle_commands(block=idle)
                if (eng.has_unfinished_requests() or self._resize is not None
                        or (idle and not woke and self.keepalive_s is not None)):
                    self._deliver(eng.step(timeout_s=0.005))
                if self._resize is not None:
                    try:
                        result = eng.resize_result()
                    except ResizeFailed as e:   # a grow's new ranks could not join: the caller hears why
                        result = e
                    self._resolve(self._resize, result)
            for rid in list(self._streams):
                self._abort(rid, None)
            while eng.has_unfinished_requests():  # the step that reports the aborts
                self._deliver(eng.step(timeout_s=0.005))
        except BaseException as e:  # step() failed (e.g. a rank was lost): fail every caller
            self._dead = e
        finally:
            self._stopping = True
            try:
                eng.shutdown()
            except BaseException as e:
                self._dead = self._dead or e
            err = self._dead or RuntimeError("engine shut down")
            for st in self._streams.values():
                self._post(st.loop, [(st, EngineDeadError(f"engine stopped: {err!r}"))])
            self._streams.clear()
            if self._resize is not None:
                self._resolve(self._resize, EngineDeadError(f"engine stopped during the resize: {err!r}"))

    def _handle_commands(self, block: bool) -> bool:
        """Run queued commands; when block, wait for one first (up to keepalive_s). -> got any."""
        try:
            cmds = [self._cmds.get(timeout=self.keepalive_s) if block else self._cmds.get_nowait()]
        except queue.Empty:
            return False
        while True:
            self._command(cmds[-1])
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return True

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, st = cmd
            try:
                if rid in self._streams:
                    raise ValueError(f"duplicate request id {rid!r}")
                self.engine.add_request(rid, prompt, params)
            except Exception as e:
                self._post(st.loop, [(st, e)])
            else:
                self._streams[rid] = st
        elif kind == "abort":
            self._abort(cmd[1], cmd[2])
        elif kind in ("metrics", "health"):
            fut = cmd[1]
            if kind == "health":
                m = self.engine.health()
            else:
                m = dict(self.engine.metrics(), **self.stats.snapshot(), active_requests=len(self._streams))
            try:
                fut.get_loop().call_soon_threadsafe(lambda: fut.done() or fut.set_result(m))
            except RuntimeError:
                pass  # the asking loop is closed
        elif kind == "resize":
            fut = cmd[2]
            try:
                done = self.engine.start_resize(cmd[1])
            except Exception as e:
                self._resolve(fut, e)
                return
            if done is None:
                self._resize = fut
            else:
                self._resolve(fut, done)
        elif kind == "stop":
            self._stopping = True

    def _resolve(self, fut: asyncio.Future, value) -> None:
        """Answer a resize's caller (value: its figures, or the exception); None: not done yet."""
        if value is None:
            return
        if fut is self._resize:
            self._resize = None

        def answer():
            if not fut.done():
                fut.set_exception(value) if isinstance(value, BaseException) else fut.set_result(value)
        try:
            fut.get_loop().call_soon_threadsafe(answer)
        except RuntimeError:
            pass  # the asking loop is closed

    def _abort(self, rid: str, st: _Stream | None) -> None:
        live = self._streams.get(rid)
        if live is None or (st is not None and live is not st):
            return
        try:
            self.engine.abort(rid)
        except ValueError:
            pass  # finished in the step that just ran; its final output is on its way

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Route outputs to their streams: one call_soon_threadsafe per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        now = time.monotonic()
        for out in outs:
            st = self._streams.get(out.request_id)
            if st is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                self.stats.record(out.metrics or {}, now - st.start)
            by_loop.setdefault(st.loop, []).append((st, out))
        for loop, items in by_loop.items():
            self._post(loop, items)

    def _post(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody will read these, stop computing them
            for st, out in items:
                if isinstance(out, RequestOutput) and not out.finished:
                    self._abort(out.request_id, st)


def _put_all(items: list) -> None:
    for st, item in items:
        st.queue.put_nowait(item)
