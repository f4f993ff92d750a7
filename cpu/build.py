"""Build the CPU kernels' C (registered by cpu/gemm.py, layers.py and fused.py) for this machine with the
system compiler at first use, load it with ctypes; say why they cannot run when they cannot.

The kernels are plain C with GCC/Clang vector extensions, so no torch headers and no build step at
install: `cc -O3 -march=native -shared` takes about a second.
The library is cached under $WIDEEP_CACHE_DIR (default ~/.cache/wideep), keyed by the source, the
compiler, its flags and this CPU's feature flags (a cache shared by different machines never loads a
library built for another CPU). Ranks that build at once each write their own file and rename it
into place, so a reader never sees a half-written library.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")


class BuildError(RuntimeError):
    """The C compiler is missing or rejected the source (the message says which, with its output)."""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> str:
    for d in (os.environ.get("WIDEEP_CACHE_DIR"), os.path.join(os.path.expanduser("~"), ".cache", "wideep"),
              os.path.join(tempfile.gettempdir(), f"wideep-{os.getuid() if hasattr(os, 'getuid') else 0}")):
        if not d:
            continue
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise BuildError("no writable cache directory for the CPU kernels (set WIDEEP_CACHE_DIR)")


def build(name: str, source: str) -> ctypes.CDLL:
    """Compile `source` (once per machine and source) and load it. Raises BuildError saying why not."""
    cc = os.environ.get("CC", "cc")
    path_cc = shutil.which(cc)
    if path_cc is None:
        raise BuildError(f"no C compiler: {cc!r} is not on PATH (install gcc or clang, or set CC)")
    key = hashlib.sha256("\0".join([source, path_cc, " ".join(FLAGS), _cpu_signature()]).encode()).hexdigest()[:16]
    lib = os.path.join(_cache_dir(), f"{name}-{key}.so")
    if not os.path.exists(lib):
        src = f"{lib}.{os.getpid()}.c"
        tmp = f"{lib}.{os.getpid()}.tmp"
        with open(src, "w") as f:
            f.write(source)
        try:
            r = subprocess.run([path_cc, *FLAGS, "-o", tmp, src, "-lm"], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise BuildError(f"{cc} could not build the {name} kernels:\n{r.stderr[-2000:]}")
            os.replace(tmp, lib)
        finally:
            for p in (src, tmp):
                if os.path.exists(p):
                    os.remove(p)
    return ctypes.CDLL(lib)


_lib: ctypes.CDLL | None = None
_error: str | None = None
_parts: list[tuple[str, dict]] = []   # (C source, {function: (argtypes, restype)}), in registration order


def register(source: str, signatures: dict) -> None:
    """A kernel module's C source and its functions' ctypes signatures, compiled as one library with
    the others (cpu/layers.py's C uses cpu/gemm.py's vector helpers, cpu/fused.py's both). Every kernel
    module registers at import, and cpu/__init__.py imports them all, so the library is whole before its
    first use."""
    if _lib is not None:
        raise RuntimeError("the CPU kernels are already built: register a source before first use")
    _parts.append((source, signatures))


def unusable() -> str | None:
    """Why the CPU kernels cannot run here (no compiler, a build error), or None once they are loaded."""
    global _lib, _error
    if _lib is None and _error is None:
        try:
            lib = build("wideep_cpu", "".join(source for source, _ in _parts))
        except BuildError as e:
            _error = str(e)
            return _error
        for _, signatures in _parts:
            for name, (argtypes, restype) in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
        _lib = lib
    return _error


def unusable_for(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot serve a model of `dtype` on `device`, or None (builds them when they could)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the device is {device}, not the CPU"
    if dtype != torch.float32:
        return f"the model dtype is {dtype}; the CPU kernels take float32"
    return unusable()


def library() -> ctypes.CDLL:
    """The loaded kernels (built on first use); RuntimeError saying why when they cannot be."""
    why = unusable()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are not usable: {why}")
    return _lib
