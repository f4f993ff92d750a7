"""The host tier: blocks evicted from the device cache, in preallocated host memory (pinned when the
pools are on CUDA, so copies run asynchronously), LRU.

Legend: C slots (host_bytes // block bytes), bs block_size, D_t the row width of tensor t (one
tensor the cache keeps per layer: the latent pool [S, D], and DSA's indexer keys [S, Dk]). buf[t]: [C, bs, D_t]; slot c holds one block's rows of
every tensor.

Ordering on CUDA: device<->host copies are enqueued on the current stream, so a spill is ordered
before the step that overwrites the device block and a load before the step that reads it; the
host side reads or writes a slot's bytes only after the slot's last copy is done (settle).
"""
from __future__ import annotations

import torch

from .lru import LRUIndex


class HostTier(LRUIndex):
    def __init__(self, capacity: int, rows: list[tuple[int, int]], dtype: torch.dtype | list[torch.dtype],
                 device: torch.device):
        """rows: (bs, D_t) per tensor; dtype: of every tensor, or one per tensor (an fp8 cache's uint8
        rows beside DSA's indexer keys); device: the pools' device (pinned host memory when CUDA)."""
        super().__init__()   # block hash -> slot
        self.capacity = capacity
        self.cuda = device.type == "cuda"
        dtypes = dtype if isinstance(dtype, list) else [dtype] * len(rows)
        self.buf = [torch.empty(capacity, bs, d, dtype=dt, pin_memory=self.cuda) for (bs, d), dt in zip(rows, dtypes)]
        self.block_nbytes = sum(b[0].numel() * b.element_size() for b in self.buf)
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: dict[int, int] = {}                     # block hash -> pin count (never evicted)
        self._last: list = [None] * capacity                # CUDA event after the slot's last copy

    def pin(self, h: int) -> None:
        self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, h: int) -> None:
        n = self._pins.pop(h) - 1
        if n:
            self._pins[h] = n

    def victim(self) -> int | None:
        """The least recently used unpinned block when the tier is full (None: not full, or all pinned)."""
        if self._free:
            return None
        return next((h for h in self._index if h not in self._pins), None)

    def add(self, h: int) -> int | None:
        """A slot for h (the caller made room: victim() was None or dropped) -> slot, None when full."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._index[h] = slot
        return slot

    def drop(self, h: int) -> None:
        self._free.append(self._index.pop(h))

    # -- moving bytes ---------------------------------------------------------------------------------
    def _settle(self, slot: int) -> None:
        ev = self._last[slot]
        if ev is not None:
            ev.synchronize()  # SYNC: the host touches a slot whose copy may still be in flight
            self._last[slot] = None

    def _record(self, slot: int) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._last[slot] = ev

    def from_device(self, h: int, pools: list[torch.Tensor], block: int) -> None:
        """Copy device block `block` (rows block*bs .. of every pool) into h's slot."""
        slot = self._index[h]
        for buf, pool in zip(self.buf, pools):
            bs = buf.shape[1]
            buf[slot].copy_(pool[block * bs:(block + 1) * bs], non_blocking=True)
        self._record(slot)

    def to_device(self, h: int, pools: list[torch.Tensor], block: int) -> None:
        slot = self._index[h]
        for buf, pool in zip(self.buf, pools):
            bs = buf.shape[1]
            pool[block * bs:(block + 1) * bs].copy_(buf[slot], non_blocking=True)
        self._record(slot)

    def to_bytes(self, h: int) -> bytes:
        slot = self._index[h]
        self._settle(slot)
        return b"".join(buf[slot].reshape(-1).view(torch.uint8).numpy().tobytes() for buf in self.buf)

    def from_bytes(self, h: int, data: bytes) -> None:
        if len(data) != self.block_nbytes:
            raise ValueError(f"a block is {self.block_nbytes} bytes here, got {len(data)}")
        slot = self._index[h]
        self._settle(slot)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        off = 0
        for buf in self.buf:
            n = buf[slot].numel() * buf.element_size()
            buf[slot].view(-1).view(torch.uint8).copy_(src[off:off + n])
            off += n
