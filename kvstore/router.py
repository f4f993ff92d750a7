"""KV-aware routing at the front: which DP rank holds which blocks, and where a prompt should go.

The index maps a block hash to the set of ranks holding it in any tier (a bit mask of global
ranks), kept from the ranks' reports (kvstore/events.py: changes only). A prompt's chain
(kvstore/hashing.py) is walked once for all candidate ranks: a rank's match is the number of
leading blocks it holds. Each candidate r costs

    cost(r) = route_load_weight * load(r) - route_prefix_weight * block_size * matched(r)

(load: tokens in flight on r, as least-loaded routing counts them) and the cheapest wins, the
lowest rank on ties, so with nothing cached anywhere this is least-loaded routing. Decisions are
counted by reason: "prefix" (the winner holds the longest prefix, and something was cached),
"load" (a rank held more of the prefix but was too busy), "no_prefix" (no candidate held any).
The index is a prediction: a block evicted since its rank last reported is a miss there, not an error.
"""
from __future__ import annotations

from collections import Counter

from .config import KVCacheConfig
from .events import KVEvents
from .hashing import prefix_chain


class PrefixRouter:
    def __init__(self, block_size: int, prefix_weight: float = 1.0, load_weight: float = 1.0):
        self.block_size, self.prefix_weight, self.load_weight = block_size, prefix_weight, load_weight
        self._holders: dict[int, int] = {}      # block hash -> bit mask of global ranks holding it
        self.blocks = Counter()                 # global rank -> blocks indexed
        self.decisions = Counter()              # reason -> requests
        self.saved_tokens = 0                   # prompt tokens the chosen ranks were expected to hold

    @classmethod
    def from_config(cls, cfg: KVCacheConfig, block_size: int, prefix_caching: bool) -> "PrefixRouter | None":
        """None when routing is least-loaded (by choice, or because nothing is cached)."""
        if cfg.routing != "kv_aware" or not prefix_caching:
            return None
        return cls(block_size, cfg.route_prefix_weight, cfg.route_load_weight)

    def update(self, rank: int, events: KVEvents) -> None:
        bit = 1 << rank
        for h in events.stored:
            m = self._holders.get(h, 0)
            if not m & bit:
                self._holders[h] = m | bit
                self.blocks[rank] += 1
        for h in events.removed:
            m = self._holders.get(h, 0)
            if m & bit:
                m &= ~bit
                if m:
                    self._holders[h] = m
                else:
                    del self._holders[h]
                self.blocks[rank] -= 1

    def forget_rank(self, rank: int) -> None:
        """A rank that is gone (or restarted empty) holds nothing."""
        bit = 1 << rank
        for h, m in list(self._holders.items()):
            if m & bit:
                if m & ~bit:
                    self._holders[h] = m & ~bit
                else:
                    del self._holders[h]
        self.blocks.pop(rank, None)

    def matched(self, hashes: list[int], ranks: list[int]) -> dict[int, int]:
        """-> rank -> how many leading blocks of the chain it holds."""
        out = dict.fromkeys(ranks, 0)
        alive = 0
        for r in ranks:
            alive |= 1 << r
        for i, h in enumerate(hashes):
            still = alive & self._holders.get(h, 0)
            if still != alive:
                for r in ranks:
                    if (alive & ~still) >> r & 1:
                        out[r] = i
            alive = still
            if not alive:
                return out
        for r in ranks:
            if alive >> r & 1:
                out[r] = len(hashes)
        return out

    def choose(self, ranks: list[int], load: dict[int, int], ids: list[int]) -> tuple[int, str, int]:
        """-> (rank, reason, prompt tokens it is expected to hold) for a prompt of token ids."""
        matched = self.matched(prefix_chain(ids, self.block_size), ranks)
        bs, pw, lw = self.block_size, self.prefix_weight, self.load_weight
        best = min(ranks, key=lambda r: (lw * load[r] - pw * bs * matched[r], r))
        most = max(matched.values())
        reason = "no_prefix" if most == 0 else "prefix" if matched[best] == most else "load"
        self.decisions[reason] += 1
        self.saved_tokens += bs * matched[best]
        return best, reason, bs * matched[best]
