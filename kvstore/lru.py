"""What a tier holds, in least-recently-used order: the one index the host and disk tiers share."""
from __future__ import annotations

from collections import OrderedDict


class LRUIndex:
    """_index: block hash -> the tier's value for it (HostTier: its slot; DiskTier: None), least
    recently used first."""

    def __init__(self):
        self._index: OrderedDict[int, object] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self._index

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> list[int]:
        """Least recently used first."""
        return list(self._index)

    def touch(self, h: int) -> None:
        self._index.move_to_end(h)
