"""Build the CPU kernels' C (cpu/csrc: the .c files and their one header, wideep.h) for this machine with
the system compiler at first use, load it with ctypes, check that every struct the launchers pass has the
layout the C has; say why the kernels cannot run when they cannot.

The kernels are plain C with GCC/Clang vector extensions, so no torch headers and no build step at
install: `cc -O3 -march=native -shared` takes a few seconds. WIDEEP_CPU_MARCH builds for another -march (x86-64-v3:
the AVX2 + FMA baseline, as .ci/avx2 does on any x86-64 machine); one this CPU cannot run (the compiler's predefined
ISA macros against /proc/cpuinfo: missing_isa) is refused, never loaded. A build that fails is logged once and the
torch paths run instead. The library is cached under
$WIDEEP_CACHE_DIR (default ~/.cache/wideep), keyed by every source file's content, the compiler, its
flags and this CPU's feature flags (a cache shared by different machines never loads a library built
for another CPU). Ranks that build at once each write their own file and rename it into place, so a
reader never sees a half-written library.

Every exported kernel takes one struct by address (wd_<name>_args in wideep.h); each launcher module
registers its ctypes twins. At load, wd_layouts() (csrc/layouts.c) gives the C offset and size of every
field and each struct's sizeof, and a ctypes Structure that differs in any of them is a LayoutError naming
the struct and the field: a struct edited on one side only fails at load, never passes garbage.

bfloat16 weights run on AVX512-BF16 dot products where the CPU has them (checked at run time, csrc/gemm_bf16dp.c);
WIDEEP_CPU_BF16_DOT=0 starts the library with them off (the widening path; gemm.bf16_dot switches at run time).
On CPUs with AMX tiles, bfloat16 weights of a few rows and more run on them (csrc/gemm_amx.c; the kernel is asked
for the tiles' state at first use); WIDEEP_CPU_AMX=0 starts with them off (gemm.amx switches at run time).

WIDEEP_CPU_SANITIZE=1 builds with AddressSanitizer and UBSan instead (a library of its own in the cache);
the process must preload the ASan runtime (.ci/sanitize shows how).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger("wideep.cpu")
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def march() -> str:
    """The CPU the library is built for: WIDEEP_CPU_MARCH (a compiler -march value: x86-64-v3 is the AVX2 + FMA
    baseline, CI builds it on any x86-64 machine), default native (this CPU)."""
    m = os.environ.get("WIDEEP_CPU_MARCH", "native").strip() or "native"
    if not all(c.isalnum() or c in "-_.+" for c in m):
        raise BuildError(f"WIDEEP_CPU_MARCH={m!r} is not a compiler -march value")
    return m


def flags(arch: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build for `arch` (default march())."""
    return ("-O3", f"-march={arch or march()}", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")


def sanitize_flags(arch: str | None = None) -> tuple[str, ...]:
    """-O1 keeps the reports' stacks readable; recover off: a UBSan finding aborts, as an ASan one does."""
    return ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            f"-march={arch or march()}", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")


FLAGS: tuple[str, ...] | None = None   # tests set it to build for another CPU; None: flags()


# the compiler's predefined macro for an instruction set -> /proc/cpuinfo's flag for it
ISA_MACROS = {"__SSE4_2__": "sse4_2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
              "__BMI2__": "bmi2", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
              "__AVX512DQ__": "avx512dq", "__AVX512CD__": "avx512cd", "__AVX512BF16__": "avx512_bf16",
              "__AVX512VNNI__": "avx512_vnni", "__AVX512FP16__": "avx512_fp16", "__AVXVNNI__": "avx_vnni",
              "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8"}


def isa_of(arch: str, cc: str | None = None) -> set[str]:
    """The x86 instruction sets (cpuinfo's flag names) a build for -march=`arch` may execute, from the compiler's
    predefined macros; empty where the compiler does not know the value or the target is not x86."""
    path_cc = shutil.which(cc or os.environ.get("CC", "cc"))
    if path_cc is None:
        return set()
    r = subprocess.run([path_cc, f"-march={arch}", "-dM", "-E", "-"], input="", capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        return set()
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return {flag for macro, flag in ISA_MACROS.items() if macro in defined}


def host_isa() -> set[str]:
    """This CPU's flags (/proc/cpuinfo), those ISA_MACROS names."""
    sig = _cpu_signature().split(":", 1)[-1].split()
    return set(sig) & set(ISA_MACROS.values())


def missing_isa(arch: str) -> list[str]:
    """The instruction sets a build for `arch` may use that this CPU lacks ([] for native: the compiler asks the
    CPU); a library built so must never run here."""
    if arch == "native":
        return []
    return sorted(isa_of(arch) - host_isa())


class BuildError(RuntimeError):
    """The C compiler is missing or rejected the source (the message says which, with its output)."""


class LayoutError(RuntimeError):
    """A ctypes Structure and the C struct it stands for disagree (the message names the struct and field)."""


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


def sanitizing() -> bool:
    return os.environ.get("WIDEEP_CPU_SANITIZE", "0") not in ("", "0")


def sources() -> dict[str, str]:
    """The kernels' C: every .c and .h file of cpu/csrc, {file name: text}, by name."""
    try:
        names = sorted(n for n in os.listdir(CSRC) if n.endswith((".c", ".h")))
    except OSError:
        names = []
    if not any(n.endswith(".c") for n in names):
        raise BuildError(f"no C sources in {CSRC} (an install without the package's csrc files?)")
    out = {}
    for n in names:
        with open(os.path.join(CSRC, n)) as f:
            out[n] = f.read()
    return out


def build(name: str, source: str | dict[str, str]) -> ctypes.CDLL:
    """Compile `source` (one C file's text, or {file name: text} of .c files and the headers they include)
    as one library, once per machine, source and flags, and load it. Raises BuildError saying why not."""
    files = {f"{name}.c": source} if isinstance(source, str) else dict(source)
    if FLAGS is None and march() != "native" and missing_isa(march()):
        raise BuildError(f"WIDEEP_CPU_MARCH={march()} builds for instructions this CPU lacks "
                         f"({', '.join(missing_isa(march()))}): the library would die with SIGILL here")
    cc = os.environ.get("CC", "cc")
    path_cc = shutil.which(cc)
    if path_cc is None:
        raise BuildError(f"no C compiler: {cc!r} is not on PATH (install gcc or clang, or set CC)")
    opts = sanitize_flags() if sanitizing() else FLAGS or flags()
    if sanitizing() and "asan" not in os.environ.get("LD_PRELOAD", ""):
        raise BuildError("WIDEEP_CPU_SANITIZE=1 needs the ASan runtime preloaded: "
                         f"LD_PRELOAD=$({cc} -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 (.ci/sanitize)")
    parts = [f"{n}\0{text}" for n, text in sorted(files.items())] + [path_cc, " ".join(opts), _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    lib = os.path.join(_cache_dir(), f"{name}{'-asan' if sanitizing() else ''}-{key}.so")
    if not os.path.exists(lib):
        tmp = f"{lib}.{os.getpid()}.tmp"
        with tempfile.TemporaryDirectory(dir=os.path.dirname(lib), prefix=f".{name}-src-") as src:
            for n, text in files.items():
                with open(os.path.join(src, n), "w") as f:
                    f.write(text)
            try:
                compile_library([path_cc], opts, src, tmp, name)
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    return ctypes.CDLL(lib)


def compile_library(cc: list[str], opts, src: str, out: str, name: str = "wideep_cpu") -> None:
    """Compile every .c file of directory src with the command cc (a compiler and its leading arguments: a cross
    compiler's target too) and opts into the shared library out; raises BuildError with the compiler's words."""
    cfiles = [os.path.join(src, n) for n in sorted(os.listdir(src)) if n.endswith(".c")]
    r = subprocess.run([*cc, *opts, "-o", out, *cfiles, "-lm"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise BuildError(f"{os.path.basename(cc[0])} could not build the {name} kernels:\n{r.stderr[-2000:]}")


def fields(names: str, ctype) -> list[tuple[str, type]]:
    """[(name, ctype)] for each space-separated name: a ctypes Structure's run of fields of one type."""
    return [(n, ctype) for n in names.split()]


class Layout(ctypes.Structure):
    """One row of wd_layouts(): a struct's field (offset, size) or, with field NULL, its sizeof in size."""
    _fields_ = fields("name field", ctypes.c_char_p) + fields("offset size", ctypes.c_int64)


def layouts(lib: ctypes.CDLL) -> dict[str, dict[str | None, tuple[int, int]]]:
    """The library's struct layouts: {struct: {field: (offset, size)}, with None: (0, sizeof)}."""
    fn = lib.wd_layouts
    fn.argtypes, fn.restype = [], ctypes.POINTER(Layout)
    rows, out = fn(), {}
    for i in range(10_000):
        r = rows[i]
        if r.name is None:
            return out
        out.setdefault(r.name.decode(), {})[None if r.field is None else r.field.decode()] = (r.offset, r.size)
    raise LayoutError("wd_layouts() has no end marker")


def check_layout(struct: str, cls: type[ctypes.Structure], table: dict) -> None:
    """Raise LayoutError naming the struct and the field when ctypes' `cls` is not C's `struct` (layouts())."""
    who = f"{struct} (ctypes {cls.__name__})"
    c = table.get(struct)
    if c is None:
        raise LayoutError(f"{who}: the library has no struct {struct}")
    names = [f[0] for f in cls._fields_]
    for n in names:
        if n not in c:
            raise LayoutError(f"{who}: field {n!r} is in the ctypes Structure, not in the C struct")
    for n in sorted((n for n in c if n is not None), key=lambda n: c[n][0]):
        if n not in names:
            raise LayoutError(f"{who}: field {n!r} is in the C struct, not in the ctypes Structure")
    for n in names:
        d = getattr(cls, n)
        if (d.offset, d.size) != c[n]:
            raise LayoutError(f"{who}: field {n!r} is at offset {d.offset}, {d.size} bytes in ctypes, at offset "
                              f"{c[n][0]}, {c[n][1]} bytes in C")
    if ctypes.sizeof(cls) != c[None][1]:
        raise LayoutError(f"{who}: sizeof is {ctypes.sizeof(cls)} in ctypes, {c[None][1]} in C")


_lib: ctypes.CDLL | None = None
_error: str | None = None
_kernels: dict[str, tuple[type[ctypes.Structure], object]] = {}   # function: (its argument struct, restype)
_structs: dict[str, type[ctypes.Structure]] = {"wd_layout": Layout}   # C struct name: its ctypes twin


def register(kernels: dict[str, tuple[type[ctypes.Structure], object]],
             structs: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """A launcher module's kernels, {C function: (ctypes twin of its wd_<function>_args, restype)}, and the
    other structs it passes ({C struct name: ctypes twin}). Checked against the library and bound at load;
    cpu/__init__.py imports every launcher module, so all are registered before the first use."""
    if _lib is not None:
        raise RuntimeError("the CPU kernels are already loaded: register before first use")
    for fn, (cls, _) in kernels.items():
        _structs[f"{fn}_args"] = cls
    _kernels.update(kernels)
    _structs.update(structs or {})


def unusable() -> str | None:
    """Why the CPU kernels cannot run here (no compiler, a build error), or None once they are loaded.
    A struct whose layout differs from the C is a bug, not a missing feature: LayoutError, raised."""
    global _lib, _error
    if _lib is None and _error is None:
        try:
            lib = build("wideep_cpu", sources())
        except BuildError as e:
            _error = str(e)
            log.warning("the CPU kernels are not built, torch's operations run instead: %s", _error)
            return _error
        table = layouts(lib)
        for struct, cls in _structs.items():
            check_layout(struct, cls, table)
        for name, (cls, restype) in _kernels.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.POINTER(cls)], restype
        _lib = lib
        if os.environ.get("WIDEEP_CPU_BF16_DOT", "1") in ("0", ""):
            lib.wd_bf16_dot(_structs["wd_bf16_dot_args"](want=0))
        if os.environ.get("WIDEEP_CPU_AMX", "1") in ("0", ""):
            lib.wd_amx(_structs["wd_amx_args"](want=0))
    return _error


def unusable_for(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot serve a model of `dtype` on `device`, or None (builds them when they could)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the device is {device}, not the CPU"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the model dtype is {dtype}; the CPU kernels take float32 or bfloat16"
    return unusable()


def library() -> ctypes.CDLL:
    """The loaded kernels (built on first use); RuntimeError saying why when they cannot be."""
    why = unusable()
    if why is not None:
        raise RuntimeError(f"the CPU kernels are not usable: {why}")
    return _lib
