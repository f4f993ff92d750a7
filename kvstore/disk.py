"""The disk tier: one file per block in a directory of this rank's own, LRU within a byte capacity.

Layout: <disk_dir>/<model identity>/rank-<k>/<block hash>.kv. A rank claims the first rank-<k>
directory it can lock (its DP rank's first), so engines that share disk_dir never write into each
other's files, and a restart takes its blocks back whatever its rank numbers are now.

File: MAGIC, a little-endian u32 header length, a JSON header {version, identity, hash, nbytes,
blake2b (of the payload)}, the payload (the block's rows of every tensor, as HostTier.to_bytes
lays them out). A file that is missing, truncated, for another identity or block, or whose payload
does not match its checksum is a miss: the block is recomputed, the file deleted.

Threads: file writes and deletes run in order on one writer thread (a write goes to a temporary
name, then os.replace: a reader never sees half a file); reads run on a small pool and return
bytes; the index (what is here, in LRU order) is touched only by the caller's thread.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .hashing import from_hex, hex_of
from .lru import LRUIndex

MAGIC = b"WIDEEPKV"
VERSION = 1
_MAX_HEADER = 4096


def encode(identity: str, h: int, payload: bytes) -> bytes:
    header = json.dumps({"version": VERSION, "identity": identity, "hash": hex_of(h), "nbytes": len(payload),
                         "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    return MAGIC + len(header).to_bytes(4, "little") + header + payload


def decode(identity: str, h: int, nbytes: int, data: bytes) -> tuple[bytes | None, str]:
    """-> (payload, "ok") or (None, why it is a miss)."""
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        return None, "not a block file"
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + n
    if n > _MAX_HEADER or start > len(data):
        return None, "truncated header"
    try:
        head = json.loads(data[len(MAGIC) + 4:start])
    except ValueError:
        return None, "corrupt header"
    if not isinstance(head, dict):
        return None, "corrupt header"
    if head.get("version") != VERSION or head.get("identity") != identity:
        return None, "another model or format"
    if head.get("hash") != hex_of(h):
        return None, "another block"
    payload = data[start:]
    if head.get("nbytes") != nbytes or len(payload) != nbytes:
        return None, "truncated"
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != head.get("blake2b"):
        return None, "checksum mismatch"
    return payload, "ok"


class DiskTier(LRUIndex):
    def __init__(self, root: str, identity: str, capacity_bytes: int, block_nbytes: int, prefer: int = 0,
                 on_change=None):
        """prefer: the rank-<k> directory to try first; on_change(h): a block came or went."""
        super().__init__()
        self.identity, self.block_nbytes = identity, block_nbytes
        self.on_change = on_change or (lambda h: None)
        self.file_nbytes = len(encode(identity, 0, b"\0" * block_nbytes))
        if capacity_bytes < self.file_nbytes:
            raise ValueError(f"kv_cache.disk_bytes ({capacity_bytes}) is smaller than one block file "
                             f"({self.file_nbytes} bytes)")
        self.capacity = capacity_bytes // self.file_nbytes
        self.dir, self._lock_fd = self._claim(os.path.join(os.path.abspath(root), identity), prefer)
        self._pending: dict[int, bytes] = {}                  # queued writes: payload (served to readers)
        self._lock = threading.Lock()
        self._ops: queue.Queue = queue.Queue()
        self.write_s = self.bytes_written = 0
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-disk-writer")
        self._writer.start()
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-disk-read")

    @staticmethod
    def _claim(base: str, prefer: int) -> tuple[str, int]:
        os.makedirs(base, exist_ok=True)
        for k in [prefer] + [k for k in range(1024) if k != prefer]:
            d = os.path.join(base, f"rank-{k}")
            os.makedirs(d, exist_ok=True)
            fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return d, fd
        raise RuntimeError(f"every rank-<k> directory under {base} (1024) is locked by another engine")

    def _scan(self) -> None:
        """Take over the files an earlier run left (oldest use first); remove temporary leftovers."""
        found = []
        for e in os.scandir(self.dir):
            if e.name.endswith(".tmp"):
                os.unlink(e.path)
            elif e.name.endswith(".kv"):
                try:
                    found.append((e.stat().st_mtime, from_hex(e.name[:-3])))
                except ValueError:
                    continue
        for _, h in sorted(found):
            self._index[h] = None
        while len(self._index) > self.capacity:
            self._evict()

    def path(self, h: int) -> str:
        return os.path.join(self.dir, hex_of(h) + ".kv")

    def write(self, h: int, payload: bytes) -> None:
        """Store a block (asynchronously; readers get it from memory until it is on disk)."""
        if h in self._index:
            self.touch(h)
            return
        while len(self._index) >= self.capacity:
            self._evict()
        self._index[h] = None
        self.on_change(h)
        with self._lock:
            self._pending[h] = payload
        self._ops.put(("write", h, payload))

    def drop(self, h: int) -> None:
        """Forget a block and delete its file (it was unreadable, or the tier is full)."""
        if h in self._index:
            del self._index[h]
            self._ops.put(("delete", h, None))
            self.on_change(h)

    def _evict(self) -> None:
        self.drop(next(iter(self._index)))

    def read_start(self, h: int) -> Future:
        """-> a Future of (payload | None, "ok" | why not, seconds)."""
        with self._lock:
            payload = self._pending.get(h)
        if payload is not None:
            fut: Future = Future()
            fut.set_result((payload, "ok", 0.0))
            return fut
        return self._readers.submit(self._read, h)

    def _read(self, h: int) -> tuple[bytes | None, str, float]:
        t0 = time.perf_counter()
        try:
            with open(self.path(h), "rb") as f:
                data = f.read(self.file_nbytes + 1)
        except OSError:
            return None, "missing", time.perf_counter() - t0
        payload, why = decode(self.identity, h, self.block_nbytes, data)
        if payload is not None:
            try:
                os.utime(self.path(h))   # recency survives a restart
            except OSError:
                pass
        return payload, why, time.perf_counter() - t0

    # -- the writer thread ----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            op = self._ops.get()
            try:
                if op is None:
                    return
                kind, h, payload = op
                if kind == "write":
                    self._write_file(h, payload)
                else:
                    try:
                        os.unlink(self.path(h))
                    except FileNotFoundError:
                        pass
            finally:
                self._ops.task_done()

    def _write_file(self, h: int, payload: bytes) -> None:
        t0 = time.perf_counter()
        path = self.path(h)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(encode(self.identity, h, payload))
            os.replace(tmp, path)
            self.bytes_written += len(payload)
        except OSError:   # a full or read-only disk: the block is simply not kept
            try:
                os.unlink(tmp)
            except OSError:
                pass
        finally:
            with self._lock:
                self._pending.pop(h, None)
            self.write_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        self._ops.join()

    def close(self) -> None:
        self.flush()
        self._ops.put(None)
        self._writer.join()
        self._readers.shutdown(wait=True)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
