"""One rank's tiers below its device cache, over the streams of its KV spec (kvstore/spec.py): a StreamTier
(kvstore/tier.py: the host tier, then the disk tier) per stream, all named by the same hash chain. The MLA family's
cache is one stream (its latents, with DSA's indexer keys in the same rows); DeepSeek-V4's several (window, csa, hca,
the boundary states).

Legend: s a stream, N_s its pool blocks, B_t the bytes one block takes in tensor t of the stream (one per layer and
name: latents, entries, indexer keys, snapshots), r_s = (sum_t B_t) / tokens_per_block(s) the stream's bytes per
token. Each per-layer tensor [N_s, ...] is moved as a 2-D view [N_s, B_t / element size] whose row is one block, so a
tier's "block_size" is 1 row. With several streams host_bytes and disk_bytes are shared by r_s: every tier holds about
as many tokens of every stream, which is what a hit needs (all streams of a prefix, kvstore's hashes naming each
stream's block).

The block manager (engine/sched/block_manager.py) calls, with the stream first:
    spill(s, block, h)      device block `block` of stream s (hash h) is about to be reused: keep its rows
    where(s, h)             "host" | "disk" (there, or being read from it) | None
    in_host(s, hashes)      how many of these blocks, from the first, s's host tier holds (touching them)
    pin/unpin(s, hashes), load(s, block, h) (-> whether it came up from disk)
    prefetch(pairs)         start reading these (stream, hash) blocks from the disk tier (as far as it holds them)
    poll() / reading(pairs) / wait(pairs, timeout_s)
"""
from __future__ import annotations

import dataclasses

import torch

from .config import KVCacheConfig
from .events import HeldLog
from .spec import KVSpec
from .tier import StreamTier


def block_rows(pools: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer tensors [N, ...] -> 2-D views [N, rest] (one row per pool block)."""
    return [p.view(p.shape[0], -1) for p in pools]


class TieredStore:
    def __init__(self, cfg: KVCacheConfig, spec: KVSpec, pools: dict[str, list[torch.Tensor]],
                 identities: dict[str, str] | None = None, prefer: int = 0, log: HeldLog | None = None):
        """pools: stream -> its per-layer tensors, [N_s, ...] each; identities: stream -> the model's identity for
        that stream's blocks (kvstore/identity.py, with a disk tier); prefer: the rank-<k> disk directory to claim
        first; log: where held blocks are marked."""
        self.cfg, self.log = cfg, log or HeldLog(enabled=False)
        rows = {s: block_rows(ps) for s, ps in pools.items()}
        nbytes = {s: sum(r.shape[1] * r.element_size() for r in rs) for s, rs in rows.items()}
        rate = {s: nbytes[s] / spec.tokens_per_block(s) for s in rows}
        total = sum(rate.values())
        if len(rows) > 1:   # (one stream: its tier says when a block does not fit)
            least = max(spec.tokens_per_block(s) * total for s in rows)   # host_bytes giving every stream one block
            for name in ("host_bytes",) + ("disk_bytes",) * ("disk" in cfg.tiers):
                have = getattr(cfg, name)
                if have < least:
                    raise ValueError(f"kv_cache.{name} ({have}) is shared by the {spec.model} streams "
                                     f"{sorted(rows)} by their bytes per token; it must be at least {int(least) + 1} "
                                     f"for one block of each (block bytes {nbytes})")
        self.stores: dict[str, StreamTier] = {}
        for s, rs in rows.items():
            share = cfg if len(rows) == 1 else dataclasses.replace(
                cfg, host_bytes=int(cfg.host_bytes * rate[s] / total),
                disk_bytes=max(1, int(cfg.disk_bytes * rate[s] / total)))
            self.stores[s] = StreamTier(share, rs, 1, identities[s] if identities else None, prefer, self.log,
                                        tokens_per_block=spec.tokens_per_block(s))
        self.has_disk = any(st.disk is not None for st in self.stores.values())

    # -- down / up, per stream -------------------------------------------------------------------------
    def spill(self, s: str, block: int, h: int) -> None:
        self.stores[s].spill(block, h)

    def where(self, s: str, h: int) -> str | None:
        st = self.stores[s]
        if h in st.host:
            return "host"
        if st.reading([h]) or (st.disk is not None and h in st.disk):
            return "disk"
        return None

    def in_host(self, s: str, hashes: list[int]) -> int:
        return self.stores[s].in_host(hashes)

    def pin(self, s: str, hashes: list[int]) -> None:
        self.stores[s].pin(hashes)

    def unpin(self, s: str, hashes: list[int]) -> None:
        self.stores[s].unpin(hashes)

    def load(self, s: str, block: int, h: int) -> bool:
        """Host block h of stream s -> its device block. -> whether it came up from the disk tier."""
        return self.stores[s].load(block, h)

    def prefetch(self, pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Start reading these (stream, hash) blocks from the disk tier, each stream's in order as far as it holds
        them (kvstore/tier.py prefetch). -> the pairs being read."""
        out = []
        for s, st in self.stores.items():
            hs = [h for t, h in pairs if t == s]
            out += [(s, h) for h in st.prefetch(hs)] if hs else []
        return out

    def poll(self) -> None:
        for st in self.stores.values():
            st.poll()

    def reading(self, pairs: list[tuple[str, int]]) -> bool:
        self.poll()
        return any(self.stores[s].reading([h]) for s, h in pairs)

    def wait(self, pairs: list[tuple[str, int]], timeout_s: float) -> None:
        for s, st in self.stores.items():
            st.wait([h for t, h in pairs if t == s], timeout_s)

    # -- the rest --------------------------------------------------------------------------------------
    def holds(self, h: int) -> bool:
        return any(st.holds(h) for st in self.stores.values())

    def stats(self) -> dict:
        """The tiers' figures summed over the streams (and, with several, each stream's host blocks)."""
        out: dict = {}
        for s, st in self.stores.items():
            one = st.stats()
            for k, v in one.items():
                out[k] = out.get(k, 0) + v
            if len(self.stores) > 1:
                out[f"kv_host_blocks_{s}"] = one["kv_host_blocks"]
        return out

    def flush(self) -> None:
        for st in self.stores.values():
            st.flush()

    def close(self, device_blocks: dict[str, list[tuple[int, int]]]) -> None:
        """Release the disk tiers (with persist_on_close, writing the host and device blocks of every stream)."""
        for s, st in self.stores.items():
            st.close(device_blocks.get(s, []))
