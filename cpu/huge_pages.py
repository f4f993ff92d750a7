"""Put a model's weights in 2 MiB pages (Linux MADV_COLLAPSE), so the CPU decode streams them faster.

A decode step reads its weights front to back; with 4 KiB pages the hardware prefetchers restart at
every page and the TLB misses every 4 KiB. MADV_COLLAPSE (Linux 6.1+, transparent huge pages not
"never") moves the pages of an existing range into huge pages synchronously: measured here, the
weights of the decode benchmark then stream at ~28 GB/s instead of ~24 with one thread. Where the
kernel, the THP setting or the memory (no free 2 MiB page) does not allow it, the pages stay as
they are: collapse is an optimisation, never a requirement.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

HUGE = 1 << 21
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@functools.lru_cache(maxsize=1)
def _libc():
    """libc with madvise typed (looked up once: find_library runs ldconfig), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _aligned(t: torch.Tensor, min_bytes: int) -> tuple[int, int] | None:
    """The 2 MiB-aligned part [lo, hi) of a CPU tensor of at least min_bytes, or None."""
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or n < min_bytes:
        return None
    lo, hi = -(-t.data_ptr() // HUGE) * HUGE, (t.data_ptr() + n) // HUGE * HUGE
    return (lo, hi) if hi > lo else None


def advise(tensors, min_bytes: int = 2 * HUGE) -> int:
    """Ask for 2 MiB pages (MADV_HUGEPAGE) over the aligned part of each fresh, not yet touched CPU tensor of at
    least min_bytes, so that the loader's reads fault in huge pages from the start: collapse() afterwards then
    finds them in place instead of copying every page (before, 14 s of a 19.8 s load of a 5 GB checkpoint were
    collapse's copy). On this project's VM the first touch of fresh memory, which its host backs page by page,
    then costs about what the copy did (the same load measured 5-30 s either way, docs/benchmarks.md); on a host
    without that cost the copy is simply gone. Where THP is "never" or the kernel refuses, nothing changes.
    -> bytes advised."""
    libc, done = _libc(), 0
    for t in tensors if libc is not None else ():
        r = _aligned(t, min_bytes)
        if r is not None and libc.madvise(r[0], r[1] - r[0], MADV_HUGEPAGE) == 0:
            done += r[1] - r[0]
    return done


def collapse(tensors, min_bytes: int = 2 * HUGE) -> int:
    """Collapse the 2 MiB-aligned part of each CPU tensor of at least min_bytes. -> bytes collapsed."""
    libc = _libc()
    if libc is None:
        return 0
    done, seen = 0, set()
    for t in tensors:
        r = _aligned(t, min_bytes)
        if r is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if libc.madvise(r[0], r[1] - r[0], MADV_COLLAPSE) == 0:
            done += r[1] - r[0]
    return done


def collapse_module(module: torch.nn.Module) -> int:
    """collapse() over a module's parameters and buffers."""
    return collapse([*module.parameters(), *module.buffers()])
