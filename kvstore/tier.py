"""One stream's tiers below a rank's device cache (kvstore/store.py TieredStore keeps one per stream): full blocks
the device cache evicts spill to the host tier, whose LRU blocks go down to the disk tier; a prompt whose prefix sits
in a lower tier loads it back instead of recomputing it.

The block manager (engine/sched/block_manager.py) calls, through the store and never touching the device itself:
    spill(block, h)         device block `block` (hash h) is about to be reused: keep its rows
    in_host(hashes)         how many of these blocks, from the first, the host tier holds
    load(block, h)          host -> device block (the host keeps its copy: an evicted block that
                            is already below costs nothing to spill again)
    prefetch(hashes)        start reading the disk blocks that continue the chain (into the host
                            tier, on reader threads); the sequence waits for them meanwhile
    poll() / reading(hashes) / wait(hashes, timeout_s)
Tiers are inclusive (a loaded block stays below), and every block is named by its hash chain
(kvstore/hashing.py); the disk tier is also keyed by the model's identity (kvstore/identity.py).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, wait as wait_futures

import torch

from .config import KVCacheConfig
from .disk import DiskTier
from .events import HeldLog
from .host import HostTier


def device_block_bytes(pools: list[torch.Tensor], block: int, block_size: int) -> bytes:
    """A device block's rows of every tensor, laid out as HostTier.to_bytes does."""
    rows = [p[block * block_size:(block + 1) * block_size].reshape(-1).view(torch.uint8) for p in pools]
    return b"".join(r.cpu().numpy().tobytes() for r in rows)  # SYNC: only when the engine closes


class StreamTier:
    """pools: every tensor holding a block's state, [S, D_t] with S = num_blocks * block_size rows (the store gives
    each stream's per-layer tensors as one row per block); identity: the model's (kvstore/identity.py), needed with a
    disk tier; prefer: the rank-<k> disk directory to claim first; log: where held blocks are marked;
    tokens_per_block: the tokens a block covers (for messages; default block_size)."""

    def __init__(self, cfg: KVCacheConfig, pools: list[torch.Tensor], block_size: int, identity: str | None,
                 prefer: int = 0, log: HeldLog | None = None, tokens_per_block: int | None = None):
        self.cfg, self.pools, self.block_size = cfg, pools, block_size
        self.log = log or HeldLog(enabled=False)
        rows = [(block_size, p.shape[1]) for p in pools]
        self.block_nbytes = sum(block_size * p.shape[1] * p.element_size() for p in pools)
        capacity = cfg.host_bytes // self.block_nbytes
        if capacity < 1:
            tokens = tokens_per_block or block_size
            raise ValueError(f"kv_cache.host_bytes ({cfg.host_bytes}) is smaller than one KV block "
                             f"({self.block_nbytes} bytes: {tokens} tokens x "
                             f"{self.block_nbytes // tokens} bytes over {len(pools)} per-layer tensors)")
        self.host = HostTier(capacity, rows, [p.dtype for p in pools], pools[0].device)
        self.disk = None
        if "disk" in cfg.tiers:
            if identity is None:
                raise ValueError("a disk tier needs the model's identity")
            self.disk = DiskTier(cfg.disk_dir, identity, cfg.disk_bytes, self.block_nbytes, prefer, self.log.mark)
            for h in self.disk.hashes():
                self.log.mark(h)
        self._reads: dict[int, Future] = {}       # block hash -> disk read in flight
        self._from_disk: set[int] = set()         # host blocks read from disk, not loaded since
        self.counts = {"spill_bytes_host": 0, "spill_bytes_disk": 0, "load_bytes_host": 0, "load_bytes_disk": 0,
                       "spills": 0, "loads": 0, "disk_reads": 0, "disk_misses": 0}
        self.seconds = {"spill": 0.0, "load": 0.0, "disk_read": 0.0}

    def holds(self, h: int) -> bool:
        return h in self.host or (self.disk is not None and h in self.disk)

    # -- down ------------------------------------------------------------------------------------------
    def _room(self) -> bool:
        """Room for one more host block: the least recently used one goes down to the disk tier (or
        away). False when every host block is pinned."""
        if len(self.host) < self.host.capacity:
            return True
        v = self.host.victim()
        if v is None:
            return False
        if self.disk is not None:
            if v in self.disk:
                self.disk.touch(v)
            else:
                self.disk.write(v, self.host.to_bytes(v))
                self.counts["spill_bytes_disk"] += self.block_nbytes
        self.host.drop(v)
        self._from_disk.discard(v)
        self.log.mark(v)
        return True

    def spill(self, block: int, h: int) -> None:
        t0 = time.perf_counter()
        if h in self.host:
            self.host.touch(h)
            return
        if not self._room():
            return   # every host block is being loaded: this one is simply evicted
        self.host.add(h)
        self.host.from_device(h, self.pools, block)
        self.log.mark(h)
        self.counts["spills"] += 1
        self.counts["spill_bytes_host"] += self.block_nbytes
        self.seconds["spill"] += time.perf_counter() - t0

    # -- up --------------------------------------------------------------------------------------------
    def in_host(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.host:
                break
            self.host.touch(h)
            n += 1
        return n

    def pin(self, hashes: list[int]) -> None:
        for h in hashes:
            self.host.pin(h)

    def unpin(self, hashes: list[int]) -> None:
        for h in hashes:
            self.host.unpin(h)

    def load(self, block: int, h: int) -> bool:
        """Host block h -> device block `block`. -> whether it came up from the disk tier."""
        t0 = time.perf_counter()
        self.host.to_device(h, self.pools, block)
        self.host.touch(h)
        self.counts["loads"] += 1
        self.counts["load_bytes_host"] += self.block_nbytes
        self.seconds["load"] += time.perf_counter() - t0
        if h in self._from_disk:
            self._from_disk.discard(h)
            return True
        return False

    def prefetch(self, hashes: list[int]) -> list[int]:
        """Start reading the blocks that continue the chain from the disk tier (as far as it holds
        them, at most what the host tier holds). -> the hashes being read."""
        if self.disk is None:
            return []
        out = []
        for h in hashes[:self.host.capacity]:
            if h in self.host and h not in self._reads:
                continue
            if h not in self.disk and h not in self._reads:
                break
            if h not in self._reads:
                self._reads[h] = self.disk.read_start(h)
                self.disk.touch(h)
            out.append(h)
        return out

    def reading(self, hashes: list[int]) -> bool:
        return any(h in self._reads for h in hashes)

    def wait(self, hashes: list[int], timeout_s: float) -> None:
        """Block until these reads are done (or timeout_s passed), then install them."""
        futs = [self._reads[h] for h in hashes if h in self._reads]
        if futs:
            wait_futures(futs, timeout=timeout_s)
        self.poll()

    def poll(self) -> None:
        """Install finished disk reads in the host tier; an unreadable file is dropped (a miss)."""
        for h, fut in list(self._reads.items()):
            if not fut.done():
                continue
            del self._reads[h]
            payload, why, seconds = fut.result()
            self.counts["disk_reads"] += 1
            self.seconds["disk_read"] += seconds
            if payload is None:
                self.counts["disk_misses"] += 1
                self.disk.drop(h)
                continue
            if h in self.host or not self._room():
                continue
            self.host.add(h)
            self.host.from_bytes(h, payload)
            self._from_disk.add(h)
            self.log.mark(h)
            self.counts["load_bytes_disk"] += self.block_nbytes

    # -- the rest --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c, s, disk = self.counts, self.seconds, self.disk
        out = {"kv_host_blocks": len(self.host), "kv_host_bytes": len(self.host) * self.block_nbytes,
               "kv_host_capacity_blocks": self.host.capacity,
               "kv_spills": c["spills"], "kv_spill_bytes_host": c["spill_bytes_host"],
               "kv_spill_bytes_disk": c["spill_bytes_disk"], "kv_spill_s": s["spill"],
               "kv_loads": c["loads"], "kv_load_bytes_host": c["load_bytes_host"],
               "kv_load_bytes_disk": c["load_bytes_disk"], "kv_load_s": s["load"]}
        if disk is not None:
            out.update(kv_disk_blocks=len(disk), kv_disk_bytes=len(disk) * disk.file_nbytes,
                       kv_disk_capacity_blocks=disk.capacity, kv_disk_reads=c["disk_reads"],
                       kv_disk_read_s=s["disk_read"], kv_disk_write_s=disk.write_s,
                       kv_disk_misses=c["disk_misses"])
        return out

    def flush(self) -> None:
        """Wait for the disk tier's queued writes (tests; close does it too)."""
        if self.disk is not None:
            self.disk.flush()

    def close(self, device_blocks: list[tuple[int, int]]) -> None:
        """Release the disk tier; with persist_on_close, first write to it what the host tier and
        the device cache (device_blocks: (block, hash), least recently used first) hold."""
        if self.disk is None:
            return
        if self.cfg.persist_on_close:
            for h in self.host.hashes():
                if h not in self.disk:
                    self.disk.write(h, self.host.to_bytes(h))
            for block, h in device_blocks:
                if h not in self.disk:
                    self.disk.write(h, device_block_bytes(self.pools, block, self.block_size))
                else:
                    self.disk.touch(h)
        self.disk.close()
        self.disk = None
