"""Lost-rank detection: a rank that dies makes every other rank exit non-zero, never hang.

Each rank runs a daemon thread that, every heartbeat_s, writes a beat counter to the rendezvous
TCPStore (key hb/<rank>) and reads everyone else's. A peer whose counter has not moved for
lost_after_s (measured on this host's monotonic clock, so clocks need not agree across nodes) is
lost; if the store itself stays unreachable that long, the process hosting it (rank 0, or the
torchrun agent) is gone. Either way the thread prints `wideep: rank N lost ...; exiting` to stderr
and exits the process with status 1 after a short grace period, during which guard_collective can
raise RankLostError in the main thread so the traceback shows where the run stopped.

Why both: gloo raises within milliseconds when a peer's socket closes, but the error does not
say which peer; NCCL does not raise at all, it waits. The heartbeat names the rank in both cases.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

DONE = b"done"  # written by a rank that shuts down cleanly: its silence afterwards is not a loss


class RankLostError(RuntimeError):
    def __init__(self, ranks: list[int], detail: str = ""):
        self.ranks = ranks
        who = ", ".join(str(r) for r in ranks)
        super().__init__(f"rank{'s' if len(ranks) > 1 else ''} {who} lost{f' ({detail})' if detail else ''}")


class Watchdog:
    """Heartbeat writer and checker for one rank.

    store_factory() returns a fresh store client used only by this thread (its own connection, with a
    short timeout, so a dead store fails fast instead of blocking the beat). store_addr (host, port),
    when given, is probed with a plain TCP connect while the store is failing: every failed store
    op logs a C++ stack trace, and a dead store would otherwise print one per beat.
    """

    def __init__(self, store_factory: Callable[[], Any], rank: int, world_size: int, heartbeat_s: float,
                 lost_after_s: float, store_host_rank: int | None = 0,
                 on_lost: Callable[[str], None] | None = None, store_addr: tuple[str, int] | None = None):
        self.rank, self.world_size = rank, world_size
        self.heartbeat_s, self.lost_after_s = heartbeat_s, lost_after_s
        self.store_host_rank = store_host_rank      # None: the launcher hosts the store, not a rank
        self._store_factory, self._store_addr = store_factory, store_addr
        self._on_lost = on_lost or _exit_process
        self._peers = [r for r in range(world_size) if r != rank]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._beat = 0
        now = time.monotonic()
        self._last_seen = {r: (None, now) for r in self._peers}   # rank -> (value, when it last changed)
        self._done: set[int] = set()
        self._store_down_since: float | None = None
        self._lost: dict[int, float] = {}                          # rank -> seconds without a beat
        self._thread = threading.Thread(target=self._run, name=f"wideep-watchdog-{rank}", daemon=True)
        self._store = None

    # -- lifecycle ---------------------------------------------------------------------------------
    @staticmethod
    def announce(store, rank: int) -> None:
        """Write this rank's first beat and an empty loss report. Call before a barrier (the
        process-group rendezvous), so that every peer's keys exist when the first check reads them."""
        store.set(f"hb/{rank}", "0")
        store.set(f"lost_by/{rank}", "")

    def start(self) -> "Watchdog":
        self._store = self._store_factory()
        self._write_beat()
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop beating; with done=True tell the peers this rank left on purpose.

        The rank hosting the store then waits (at most lost_after_s + 2 beats) for the peers to say
        done too: its exit takes the store down, and a peer still finishing must have seen its
        done marker by then, or it would report the host as lost."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.heartbeat_s + 5)
        if not done or self._store is None:
            return
        try:
            self._store.set(f"hb/{self.rank}", DONE)
            if self.rank == self.store_host_rank:
                deadline = time.monotonic() + self.lost_after_s + 2 * self.heartbeat_s
                keys = [f"hb/{r}" for r in self._peers if r not in self._lost]
                while keys and time.monotonic() < deadline and any(v != DONE for v in self._store.multi_get(keys)):
                    time.sleep(min(0.05, self.heartbeat_s))
        except Exception:  # the store is gone already: nobody is left to tell
            pass

    # -- queries (any thread) ----------------------------------------------------------------------
    def lost_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._lost)

    def wait_lost(self, timeout_s: float) -> list[int]:
        """Poll until some rank is declared lost or timeout_s passes; [] if none."""
        deadline = time.monotonic() + timeout_s
        while True:
            lost = self.lost_ranks()
            if lost or time.monotonic() >= deadline or not self._thread.is_alive():
                return lost
            time.sleep(min(0.1, self.heartbeat_s))

    def linger_for_peers(self) -> None:
        """On the rank hosting the store: before exiting over a lost rank, wait (bounded) until every
        surviving peer has reported the loss too, or has left. Exiting at once would take the store
        down and leave the others unable to tell who was lost."""
        if self.rank != self.store_host_rank or self._store is None:
            return
        deadline = time.monotonic() + self.lost_after_s + 2 * self.heartbeat_s
        peers = [r for r in self._peers if r not in self.lost_ranks()]
        try:
            while peers and time.monotonic() < deadline:
                reports = self._store.multi_get([f"lost_by/{r}" for r in peers])
                beats = self._store.multi_get([f"hb/{r}" for r in peers])
                peers = [r for r, rep, hb in zip(peers, reports, beats) if not rep and hb != DONE]
                time.sleep(min(0.05, self.heartbeat_s))
        except Exception:
            pass

    def describe(self, ranks: list[int]) -> str:
        with self._lock:
            return "; ".join(f"rank {r}: no heartbeat for {self._lost.get(r, 0.0):.1f} s" for r in ranks)

    # -- the thread --------------------------------------------------------------------------------
    def _write_beat(self) -> None:
        self._beat += 1
        self._store.set(f"hb/{self.rank}", str(self._beat))

    def _store_back(self) -> bool:
        if self._store_addr is None:
            return True
        try:
            socket.create_connection(self._store_addr, timeout=self.heartbeat_s).close()
            return True
        except OSError:
            return False

    def _check(self, now: float) -> dict[int, float]:
        try:
            if self._store_down_since is not None:
                if not self._store_back():
                    raise ConnectionError("store unreachable")
                self._store = self._store_factory()
            self._write_beat()
            values = self._store.multi_get([f"hb/{r}" for r in self._peers]) if self._peers else []
            reports = self._store.multi_get([f"lost_by/{r}" for r in self._peers]) if self._peers else []
            self._store_down_since = None
        except Exception:
            if self._store_down_since is None:
                self._store_down_since = now
            down = now - self._store_down_since
            if down <= self.lost_after_s or self.store_host_rank in self._done:
                return {}  # a host that said done took its store with it on purpose
            # The store lives in rank 0 (or the launcher agent); its rank is the one we name.
            return {self.store_host_rank if self.store_host_rank is not None else 0: down}
        lost = {}
        for r, v in zip(self._peers, values):
            if v == DONE:
                self._done.add(r)
                continue
            old, since = self._last_seen[r]
            if v != old:
                self._last_seen[r] = (v, now)
            elif now - since > self.lost_after_s and r not in self._done:
                lost[r] = now - since
        # A peer that already declared someone lost: adopt its verdict, so every survivor names the
        # same rank even when its own view of that rank's beat is a little younger.
        for rep in reports:
            for x in (int(v) for v in rep.decode().split(",") if v) if rep else ():
                if x != self.rank and x not in self._done:
                    lost.setdefault(x, now - self._last_seen.get(x, (None, now))[1])
        if lost:
            try:
                self._store.set(f"lost_by/{self.rank}", ",".join(str(r) for r in sorted(lost)))
            except Exception:
                pass
        return lost

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            lost = self._check(time.monotonic())
            if not lost or self._stop.is_set():
                continue
            with self._lock:
                self._lost.update(lost)
            msg = "; ".join(f"wideep: rank {r} lost (no heartbeat for {age:.1f} s)" for r, age in lost.items())
            if self._store_down_since is not None:
                host = "the launcher" if self.store_host_rank is None else f"rank {self.store_host_rank}"
                msg += f" [the rendezvous store hosted by {host} is unreachable]"
            # Give the main thread a moment to turn its failed collective into RankLostError, then go.
            print(f"{msg}; exiting (this is rank {self.rank})", file=sys.stderr, flush=True)
            self._stop.wait(min(2.0, self.heartbeat_s))
            self.linger_for_peers()
            if not self._stop.is_set():
                self._on_lost(msg)
            return


def _exit_process(msg: str) -> None:
    sys.stderr.flush()
    os._exit(1)  # a normal exit could block forever in a collective or a process-group destructor


@contextmanager
def guard_collective(ctx):
    """Turn a collective's failure caused by a dead peer into RankLostError naming that peer.

    gloo raises as soon as a peer's socket closes, before the heartbeat is stale; wait up to the
    loss threshold for the watchdog to say who it was. Other errors pass through unchanged.
    """
    try:
        yield
    except RuntimeError as e:
        wd = getattr(ctx, "watchdog", None)
        if isinstance(e, RankLostError) or wd is None:
            raise
        lost = wd.wait_lost(wd.lost_after_s + 2 * wd.heartbeat_s)
        if lost:
            wd.linger_for_peers()
            raise RankLostError(lost, wd.describe(lost)) from e
        raise
