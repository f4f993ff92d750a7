"""What a lost rank looks like to the code that meets it: RankLostError, raise_if_lost (the check
outside collectives), guard_collective (a failed collective turned into the error naming the lost
rank), and the counting store the watchdog uses."""
from __future__ import annotations

import threading
from contextlib import contextmanager


class RankLostError(RuntimeError):
    def __init__(self, ranks: list[int], detail: str = ""):
        self.ranks = ranks
        who = ", ".join(str(r) for r in ranks)
        super().__init__(f"rank{'s' if len(ranks) > 1 else ''} {who} lost{f' ({detail})' if detail else ''}")


def raise_if_lost(ctx) -> None:
    """RankLostError naming the ranks ctx (a ParallelContext) has declared lost so far, described by
    its watchdog; nothing when there are none. The one check of a loop or an API call that is not
    inside a collective (guard_collective is for those)."""
    lost = ctx.lost_ranks()
    if lost:
        wd = ctx.watchdog
        raise RankLostError(lost, wd.describe(lost) if wd is not None else "")


class CountingStore:
    """A store client whose operations are counted into `counts` (shared, thread-safe): by kind, and
    "keys" for the keys they touch (a multi_get of n keys is one operation and n keys)."""

    OPS = ("set", "get", "add", "wait", "compare_set", "multi_get", "multi_set", "check", "delete_key")

    def __init__(self, store, counts: dict[str, int], lock: threading.Lock):
        self._store, self._counts, self._lock = store, counts, lock

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)
        if name not in self.OPS:
            return fn

        def counted(*args, **kwargs):
            keys = len(args[0]) if args and isinstance(args[0], (list, tuple)) else 1
            with self._lock:
                self._counts[name] = self._counts.get(name, 0) + 1
                self._counts["keys"] = self._counts.get("keys", 0) + keys
            return fn(*args, **kwargs)
        return counted


@contextmanager
def guard_collective(ctx):
    """Turn a collective's failure caused by a lost peer into RankLostError naming that peer.

    gloo raises as soon as a peer's socket closes, and the watchdog sees the same close at once; a
    collective that timed out waited on a peer whose silence has run out too. Wait up to
    lost_after_s for the verdict; other errors pass through unchanged.
    """
    try:
        yield
    except RuntimeError as e:
        wd = getattr(ctx, "watchdog", None)
        if isinstance(e, RankLostError) or wd is None:
            raise
        lost = wd.wait_lost(wd.lost_after_s + 2 * wd.heartbeat_s)
        if lost:
            if wd.exits_on_loss:
                wd.linger_for_peers()
            else:   # a custom reaction (on_rank_loss = "continue"): it may end the job; it goes first
                wd.wait_reacted(wd.lost_after_s)
            raise RankLostError(lost, wd.describe(lost)) from e
        raise
