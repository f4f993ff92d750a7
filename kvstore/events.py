"""What a rank tells the front about the blocks it holds, for KV-aware routing: changes only.

A rank holds a block when any of its tiers (device cache, host, disk) has it. Every place that adds
or drops a block marks its hash; each Report carries, for up to `limit` marked hashes, whether the
rank now holds it (stored) or no longer does (removed) compared with what it told the front before.
So a report's size follows the cache's churn since the last report, never the cache's size; hashes
over the limit wait for the next report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class KVEvents:
    stored: list[int] = field(default_factory=list)     # block hashes this rank now holds
    removed: list[int] = field(default_factory=list)    # block hashes it no longer holds


class HeldLog:
    """enabled: False keeps nothing (the front routes by load only)."""

    def __init__(self, enabled: bool = True, limit: int = 4096):
        self.enabled, self.limit = enabled, limit
        self._marked: dict[int, None] = {}    # an ordered set: oldest change first
        self._told: set[int] = set()          # what the front was told this rank holds

    def mark(self, h: int) -> None:
        if self.enabled:
            self._marked[h] = None

    @property
    def pending(self) -> bool:
        return bool(self._marked)

    def take(self, holds: Callable[[int], bool]) -> KVEvents | None:
        """The changes of up to `limit` marked hashes (None: nothing changed)."""
        out = KVEvents()
        for _ in range(min(self.limit, len(self._marked))):
            h = next(iter(self._marked))
            del self._marked[h]
            held = holds(h)
            if held and h not in self._told:
                self._told.add(h)
                out.stored.append(h)
            elif not held and h in self._told:
                self._told.discard(h)
                out.removed.append(h)
        return out if out.stored or out.removed else None
