"""Lost-rank detection: a rank that dies is named by every survivor, which exits non-zero instead of
hanging; a rank that is only slow is left alone for the full timeout.

Per rank, at any world size:
- two ring links (parallel/ring.py): beats to the ring neighbours over plain TCP. A closed
  connection, a refused connect or a vanished pid is evidence of death, acted on at once; silence
  becomes a loss only after timeout_s.
- every rank passes each loss it newly learns to its ring neighbours, so a verdict goes around the
  ring both ways from the ranks that saw it, and a neighbour that exits over a loss is not blamed
  for its EOF. One ring thread per rank does all of it: no store traffic in steady state.
- a verdict log in the rendezvous store: keys verdict/1, verdict/2, ..., each JSON
  {"by": rank, "lost": {rank: reason}}. A rank with evidence appends one entry (compare_set on the
  first free index). The log is the order every rank agrees on; it is read on demand (a caller
  whose collective failed reads it while waiting for a verdict: one hop, whatever the ring's
  length), never polled.
- the store's own process: with the store in rank 0, rank 0's ring neighbours see it die; with the
  store in the torchrun agent, every rank holds an idle connection to it that closes if it dies.

No thread of the watchdog ever sits in a blocking call into torch: a daemon thread that returns
from one while the interpreter is finalizing aborts the process.

The reaction is on_lost(ranks, message); by default `wideep: rank N lost (...); exiting` on stderr
and exit status 1 after a short grace, during which guard_collective turns the main thread's
failed collective into RankLostError. A policy that keeps running (elastic EP) would act on
verdicts() only, the agreed log, and re-form its groups without the lost ranks.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

from .lost import CountingStore, RankLostError, guard_collective, raise_if_lost  # noqa: F401 (re-exported)
from .ring import Ring


class Watchdog:
    """Lost-rank detector for one rank.

    store_factory() returns a client of the rendezvous store; it is called once, on first need, and
    may return the process's own client (store clients are thread-safe, and a connection of its own
    per rank would be a burst of W connects on one server at start-up). store_addr (host, port) is
    where that store listens; store_host_rank the rank whose process serves it, None when the
    launcher does. lost_after_s bounds how long a caller whose collective or store call just failed
    waits for a verdict: a death shows at once, and a silent peer's timeout_s ran out before any
    collective waiting on it timed out.
    """

    def __init__(self, store_factory: Callable[[], Any], rank: int, world_size: int, *, heartbeat_s: float,
                 timeout_s: float, lost_after_s: float, store_host_rank: int | None = 0,
                 on_lost: Callable[[list[int], str], None] | None = None,
                 store_addr: tuple[str, int] | None = None, host: str = "127.0.0.1", advertise: str | None = None):
        self.rank, self.world_size = rank, world_size
        self.heartbeat_s, self.timeout_s, self.lost_after_s = heartbeat_s, timeout_s, lost_after_s
        self.store_host_rank = store_host_rank
        self._store_factory, self._store_addr = store_factory, store_addr
        self.exits_on_loss = on_lost is None      # the default reaction: name the loss and exit
        self._on_lost = on_lost or self._exit_on_loss
        self.host, self.advertise = host, advertise
        self._ops: dict[str, int] = {}
        self._ops_lock = threading.Lock()
        self._ring = Ring(rank, world_size, heartbeat_s, timeout_s, host, advertise)
        self._lock = threading.Lock()
        self._lost: dict[int, str] = {}             # rank -> reason, from any source
        self._log: list[dict] = []                  # verdict log entries read, in log order
        self._store = None                          # CountingStore, made on first use
        self._client_lock = threading.Lock()
        self._read_lock = threading.Lock()          # one reader of the verdict log at a time
        self._lost_event = threading.Event()
        self._reactions = threading.Condition()   # guards _reacting: reactions started, not yet returned
        self._reacting = 0
        self._stop = threading.Event()
        self._acked = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"wideep-watchdog-{rank}", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        """Publish this rank's ring address, connect to the successor (its address is waited for,
        up to timeout_s), start the thread. Every rank calls it once all are known to be up (after
        the process-group rendezvous). One store operation, two when this rank opens a link."""
        store = self._client()
        store.set(f"ring/{self.rank}", self._ring.record)
        if self.store_host_rank is None and self._store_addr is not None:
            self._ring.watch_store(self._store_addr)
        self._thread.start()  # beating the predecessor already: waiting on the successor is not silence
        if self._ring.opens:
            try:
                self._ring.set_successor(store.get(f"ring/{self._ring.succ}").decode())  # waits up to timeout_s
            except Exception as e:
                if "timeout" not in str(e).lower():
                    raise
                self._adopt({self._ring.succ: f"did not join the watchdog ring within {self.timeout_s:g} s, "
                                              f"seen by rank {self.rank}"}, own=True)
        return self

    @property
    def on_lost(self):
        return self._on_lost

    @property
    def store_addr(self):
        return self._store_addr

    def stop(self, done: bool = True, linger: bool = True) -> None:
        """Stop watching; with done=True tell the neighbours this rank leaves on purpose.

        The rank hosting the store then waits (at most lost_after_s + 2 beats) for the others to
        leave too: its exit takes the store down under any rank still using it. linger=False: the
        process goes on (the store with it), e.g. to re-form the ranks after a loss."""
        if self._stop.is_set():
            return
        if done:
            # A neighbour not connected yet would find this rank gone without a goodbye: a loss.
            deadline = time.monotonic() + self.lost_after_s
            while not self._ring.settled() and self._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            self._ring.send_goodbye()
        self._stop.set()
        self._ring.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.heartbeat_s + 5)
        if not done or not linger or self.store_host_rank is None or not self._store_up():
            return
        try:
            store = self._client()
            if self.rank == self.store_host_rank:
                self._wait_count(store, "left", self.world_size - 1 - len(self.lost_ranks()))
            else:
                store.add("left", 1)
        except Exception:
            pass  # the store went away meanwhile: nobody is left to tell

    # -- queries (any thread) ----------------------------------------------------------------------
    def lost_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._lost)

    def silent_ranks(self, after_s: float) -> dict[int, float]:
        """Ring neighbours not heard from for more than after_s and not declared lost (yet): {rank:
        seconds}. A stopped watchdog hears nobody: {}."""
        if self._stop.is_set():
            return {}
        lost = set(self.lost_ranks())
        return {r: s for r, s in self._ring.silences().items() if s > after_s and r not in lost}

    def verdicts(self) -> list[dict]:
        """The verdict log read to its end: the same sequence on every rank."""
        self._read_log()
        with self._lock:
            return list(self._log)

    def wait_lost(self, timeout_s: float) -> list[int]:
        """Block until some rank is declared lost or timeout_s passes; [] if none. Meanwhile the
        verdict log is read once a beat (on a helper thread: a stalled store must not stretch the
        wait), so a verdict arrives in one hop even from far along the ring."""
        deadline = time.monotonic() + timeout_s
        while not self._lost_event.wait(max(0.0, min(self.heartbeat_s, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            if not self._read_lock.locked():
                threading.Thread(target=self._read_log, daemon=True).start()
        return self.lost_ranks()

    def describe(self, ranks: list[int]) -> str:
        with self._lock:
            return "; ".join(f"rank {r}: {self._lost.get(r, 'lost')}" for r in ranks)

    def stats(self) -> dict:
        """Counters for benchmarks: store operations (total, by kind, keys touched), beats, uptime."""
        with self._ops_lock:
            ops = dict(self._ops)
        keys = ops.pop("keys", 0)
        links = self._ring.links.values()
        return dict(store_ops=sum(ops.values()), store_keys=keys, store_ops_by_kind=ops,
                    beats_sent=self._ring.beats_sent, beats_received=sum(l.beats_received for l in links),
                    ring_links=len(links), uptime_s=time.monotonic() - self._started)

    def linger_for_peers(self) -> None:
        """On the rank hosting the store: before exiting over a loss, wait (bounded) until every
        survivor acknowledged it, so the store outlives their reading of the log."""
        if self.rank != self.store_host_rank:
            return
        try:
            self._wait_count(self._client(), "acked", self.world_size - 1 - len(self.lost_ranks()))
        except Exception:
            pass

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got = self._ring.poll(self._ring.next_beat_in())
                if got.told:
                    self._adopt(got.told, own=False)
                if got.dead:
                    self._adopt(got.dead, own=True)
                if got.store_closed and not self._stop.is_set():
                    # A launcher-hosted store is named as rank 0, on rank 0 too: every rank must react.
                    self._adopt({0: "the rendezvous store hosted by the launcher closed its connection: the "
                                    "launcher is gone"}, own=False, mine_too=True)
        finally:
            self._ring.flush(timeout_s=1.0)
            self._ring.close()

    # -- verdicts ----------------------------------------------------------------------------------
    def _adopt(self, lost: dict[int, str], own: bool, mine_too: bool = False) -> None:
        with self._lock:
            new = {r: why for r, why in lost.items() if (mine_too or r != self.rank) and r not in self._lost}
            if not new or self._stop.is_set():
                return
            self._ring.send_lost(new)   # first: a neighbour must never see this rank leave unexplained
            self._lost.update(new)
            for r in new:
                self._ring.stop_watching(r)
        with self._reactions:   # counted before the event: a waiter that sees the loss sees its reaction
            self._reacting += 1
        self._lost_event.set()
        if own:
            threading.Thread(target=self._publish, args=(new,), daemon=True).start()
        threading.Thread(target=self._react, args=(new,), daemon=True).start()

    def _publish(self, new: dict[int, str]) -> None:
        payload = json.dumps({"by": self.rank, "lost": {str(r): why for r, why in new.items()}}, sort_keys=True)
        try:
            if not self._store_up():
                return        # the store is gone: the ring carries the verdict
            store = self._client()
            k = len(self._log) + 1
            while store.compare_set(f"verdict/{k}", "", payload) != payload.encode():
                k += 1
        except Exception:
            pass

    def _read_log(self) -> None:
        """Adopt the log's entries not read yet: one check (+ one get per new entry)."""
        with self._read_lock:
            try:
                if not self._store_up():
                    return
                store = self._client()
                while True:
                    key = f"verdict/{len(self._log) + 1}"
                    if not store.check([key]):
                        return
                    entry = json.loads(store.get(key))
                    with self._lock:
                        self._log.append(entry)
                    self._adopt({int(r): why for r, why in entry["lost"].items()}, own=False)
            except Exception:
                pass  # the store is gone or slow: the ring still carries verdicts

    def _react(self, new: dict[int, str]) -> None:
        ranks = sorted(new)
        msg = "; ".join(f"wideep: rank {r} lost ({new[r]})" for r in ranks)
        host = self.store_host_rank
        if not self._acked and host not in (None, self.rank) and host not in self._lost:
            self._acked = True  # the host lingers for this; never wait on a store that may be gone
            threading.Thread(target=self._ack, daemon=True).start()
        try:
            self._on_lost(ranks, msg)
        finally:
            with self._reactions:
                self._reacting -= 1
                self._reactions.notify_all()

    def wait_reacted(self, timeout_s: float) -> None:
        """Block until the reactions to the verdicts so far have returned (or timeout_s passes): a
        caller raising over a loss lets the reaction speak first (or end the process, for a loss
        that ends the job)."""
        with self._reactions:
            self._reactions.wait_for(lambda: self._reacting == 0, timeout_s)

    def _ack(self) -> None:
        try:
            if self._store_up():
                self._client().add("acked", 1)
        except Exception:
            pass

    def _exit_on_loss(self, ranks: list[int], msg: str) -> None:
        print(f"{msg}; exiting (this is rank {self.rank})", file=sys.stderr, flush=True)
        self._stop.wait(min(2.0, self.heartbeat_s))  # the main thread may raise RankLostError meanwhile
        self.linger_for_peers()
        if not self._stop.is_set():
            sys.stderr.flush()
            os._exit(1)  # a normal exit could block forever in a collective or a process-group destructor

    # -- helpers -----------------------------------------------------------------------------------
    def _client(self) -> CountingStore:
        with self._client_lock:
            if self._store is None:
                self._store = CountingStore(self._store_factory(), self._ops, self._ops_lock)
            return self._store

    def _store_up(self) -> bool:
        """A plain connect to the store's port: a store client's constructor would instead retry a
        dead store for the whole timeout."""
        if self._store_addr is None:
            return True
        try:
            socket.create_connection(self._store_addr, timeout=max(1.0, self.heartbeat_s)).close()
            return True
        except OSError:
            return False

    def _wait_count(self, store, key: str, want: int) -> None:
        deadline = time.monotonic() + self.lost_after_s + 2 * self.heartbeat_s
        while want > 0 and time.monotonic() < deadline and int(store.add(key, 0)) < want:
            time.sleep(min(0.05, self.heartbeat_s))
