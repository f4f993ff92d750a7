"""Which C kernels run in place of torch's operations, chosen by measurement on this machine.

The C kernels win on some CPUs and lose on others (an AVX-512 Xeon against an AVX2-only EPYC, torch's oneDNN and
MKL kernels against ours, one thread against several), so "auto" does not trust a table measured elsewhere: at first
use each kernel is timed against the torch operation it replaces, on this CPU, at the thread count torch runs with,
over a grid of sizes, and runs only where it wins:
  linear_f32, linear_bf16   cpu/linear.py's GEMM (float32 / bfloat16 weights, float32 rows) against F.linear, at
                            1, 2, 4, ... rows up to the built-in cap: the rows up to which C runs (0: never);
  experts_f32, experts_bf16 the routed experts (cpu/gemm.py experts) against torch's grouped GEMMs (the sort, padded
                            bmm or per-expert GEMM of moe/experts.py forward_grouped), by mean rows per expert: the
                            rows per expert up to which C runs (0: never);
  mla_decode                the paged latent decode (cpu/layers.py mla_decode) against the torch path's gather, bmm
                            and softmax: 1 (C) or 0 (torch);
  bf16_widen                for the bfloat16 projections past the C kernel's rows (a prefill's): torch's bfloat16
                            F.linear against F.linear on float32 copies (x and w widened for the call; faster where
                            the CPU has no bfloat16 dot products), at 256 rows: 1 (widen) or 0.
A size counts as won when C's best time is at most torch's (within 10 % of it: the median of three measurements,
for a shared machine's noise); a kernel's limit is the last grid point of the run of
wins from the smallest size (measuring stops at the first loss). The limits never exceed the built-in ones
(cpu/linear.py: where the fused decode and the experts kernel were designed to stop; bf16_widen is a switch). The
backends stay "cpu" where the kernels build: these limits pick C or torch per call, and the fused decode, whose one
call per step a kernel-by-kernel comparison does not price, is measured on the model (engine/model/fused_decode.py).

Measured once per machine: the results are kept beside the built library (build.py's cache directory), keyed by the
library (its sources, flags and CPU), torch's version, the thread count and the environment variables that cap
either side (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, WIDEEP_CPU_BF16_DOT, WIDEEP_CPU_AMX);
ranks that start together take a file lock, so one measures (about a second) and the others read its file, and every
rank of a host runs the same kernels.

WIDEEP_CPU_TUNE=off: the built-in limits instead (measured on an AVX-512 / AMX Xeon; the tests use them so every CPU
runs the same paths). `wideep env` prints the CPU's features and the choices; the server's /metrics has them as
wideep_cpu_kernel_limit{kernel=...}; the first choice is logged once.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch

log = logging.getLogger("wideep.cpu")

KERNELS = ("linear_f32", "linear_bf16", "experts_f32", "experts_bf16", "mla_decode", "bf16_widen")
ENV_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "WIDEEP_CPU_BF16_DOT",
            "WIDEEP_CPU_AMX")
LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
EXPERT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def tuning() -> bool:
    """Whether the choices are measured (WIDEEP_CPU_TUNE unset or "measure"), not the built-in limits ("off")."""
    v = os.environ.get("WIDEEP_CPU_TUNE", "measure")
    if v not in ("measure", "off", "0", "1", ""):
        raise ValueError(f"WIDEEP_CPU_TUNE={v!r}: 'measure' or 'off'")
    return v in ("measure", "1", "")


_registered: dict[str, tuple] = {}   # kernel -> (builtin limit (), measure (cap) -> (limit, {size: ratio}))


def register(kernel: str, builtin, measure) -> None:
    """A kernel module's entry (cpu/linear.py, cpu/layers.py: each measures its own kernel against torch's):
    builtin() -> its built-in limit; measure(cap) -> (limit, {size: C time / torch time}), at most cap. cpu/__init__.py
    imports every kernel module, so all are registered before the first choice."""
    if kernel not in KERNELS:
        raise ValueError(f"tune.register: {kernel!r} is not one of {KERNELS}")
    _registered[kernel] = (builtin, measure)


def _kernels() -> dict[str, tuple]:
    """Every kernel's entry; the GEMM and experts ones come with cpu/linear.py, imported here if nothing has yet (the
    package imports the launchers, not linear.py, which sits above them)."""
    if len(_registered) < len(KERNELS):
        import importlib
        importlib.import_module(f"{__package__}.linear")
    return _registered


def builtin() -> dict[str, int]:
    """The limits without measuring (cpu/linear.py's constants, the AMX / bf16-dot cases included)."""
    return {k: _kernels()[k][0]() for k in KERNELS}


def cpu_features() -> dict:
    """The CPU's model name, the ISA flags the kernels care about, and the library's own run-time switches."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform
    return {"cpu": model or platform.processor() or platform.machine(), "machine": platform.machine(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


_choices: dict[int, dict] = {}   # torch's thread count -> its choices
_measuring = False
_MEASURING_LIMITS = dict.fromkeys(KERNELS, 1 << 30)


def choices() -> dict:
    """{"limits": {kernel: limit}, "measured": bool, "ratios": {kernel: {size: C time / torch time}}, "key": ...}.
    Measured once per machine (see the module's docstring); the built-in limits with WIDEEP_CPU_TUNE=off or where
    the C kernels cannot run (then every limit is 0)."""
    threads = torch.get_num_threads()
    got = _choices.get(threads)
    if got is not None:
        return got
    from .build import unusable
    if unusable() is not None:
        got = {"limits": dict.fromkeys(KERNELS, 0), "measured": False, "ratios": {},
               "why": f"the C kernels are not usable: {unusable()}"}
    elif not tuning():
        got = {"limits": builtin(), "measured": False, "ratios": {}, "why": "WIDEEP_CPU_TUNE=off"}
    else:
        got = _measured()
    _choices[threads] = got
    return got


def _measured() -> dict:
    from .build import _cache_dir
    key = _key()
    path = os.path.join(_cache_dir(), f"tune-{key}.json")
    got = _read(path)
    if got is None:
        import fcntl
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # one process of this host measures; the others wait and read
            got = _read(path)
            if got is None:
                got = measure()
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(got, f)
                os.replace(tmp, path)
    got["key"] = key
    log.info("CPU kernels, measured against torch at %d thread(s) on %s: %s", got["threads"],
             cpu_features()["cpu"], describe(got["limits"]))
    return got


def limit(kernel: str) -> int:
    """choices()'s limit for one kernel (rows for the GEMMs, mean rows per expert for the experts, 0/1), at the
    thread count torch runs with now."""
    got = _choices.get(torch.get_num_threads())
    if got is None and _measuring:   # the kernels being measured ask: they run as C
        return _MEASURING_LIMITS[kernel]
    return (got or choices())["limits"][kernel]


def describe(limits: dict) -> str:
    """One line: where each kernel runs C."""
    def rows(k):
        n = limits[k]
        return "torch" if n == 0 else f"C up to {n} rows"
    return (f"linear f32 {rows('linear_f32')}, bf16 {rows('linear_bf16')}; experts f32 {rows('experts_f32')} "
            f"per expert, bf16 {rows('experts_bf16')} per expert; "
            f"mla_decode {'C' if limits['mla_decode'] else 'torch'}; "
            f"bfloat16 rows past the C on {'float32 copies' if limits['bf16_widen'] else 'torch bfloat16'}")


def _key() -> str:
    import hashlib
    from .build import library
    lib = library()._name
    import sys
    method = hashlib.sha256()
    for path in sorted({__file__, *(sys.modules[m.__module__].__file__ for _, m in _kernels().values())}):
        with open(path, "rb") as f:   # how it measures is part of the key
            method.update(f.read())
    method = method.hexdigest()
    parts = [os.path.basename(lib), method, torch.__version__, str(torch.get_num_threads()),
             *(f"{v}={os.environ.get(v, '')}" for v in ENV_CAPS)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and set(got.get("limits", {})) == set(KERNELS) else None


def compare(c_fn, torch_fn, trials: int = 5) -> float:
    """C's best time over torch's, trials interleaved (one warm-up call each first)."""
    c_fn(), torch_fn()

    def once(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    c = t = float("inf")
    for _ in range(trials):
        c, t = min(c, once(c_fn)), min(t, once(torch_fn))
    return c / t


CLOSE = 0.1   # a ratio this near 1 is measured twice more and the median taken: a shared machine's noise is this big


def run_of_wins(sizes, cap: int, ratio_at) -> tuple[int, dict]:
    """The last size of the run of wins (ratio <= 1) from the smallest, measuring up to `cap` and stopping at the
    first loss; a ratio within CLOSE of 1 is the median of three measurements; -> (limit, {size: ratio})."""
    won, ratios = 0, {}
    for s in sizes:
        if s > cap:
            break
        r = ratio_at(s)
        if abs(r - 1.0) < CLOSE:
            r = sorted((r, ratio_at(s), ratio_at(s)))[1]
        ratios[s] = round(r, 3)
        if r > 1.0:
            break
        won = s
    return won, ratios


def measure() -> dict:
    """Time every kernel against torch now (the module's docstring says how); -> choices() without "key"."""
    global _measuring
    _measuring = True
    try:
        return _measure()
    finally:
        _measuring = False


def _measure() -> dict:
    t0 = time.perf_counter()
    limits, ratios = {}, {}
    for k in KERNELS:
        builtin_limit, measure_ = _kernels()[k]
        limits[k], ratios[k] = measure_(builtin_limit())
    return {"limits": limits, "measured": True, "ratios": ratios, "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 2), **cpu_features()}


def llc_bytes() -> int:
    """The last-level cache's size (sysfs; 32 MiB where it does not say)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    t = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
            best = max(best, int(t.rstrip("KMG") or 0) * mult)
    except OSError:
        pass
    return best or 32 << 20


def streamed(N: int, K: int, dt: torch.dtype) -> list[torch.Tensor]:
    """Weights [N, K] enough to overflow the last-level cache (twice its size, 64 MiB to 1 GiB in all): calls that
    take them in turn read each from memory, as a decode step reads a model's weights."""
    one = N * K * torch.empty((), dtype=dt).element_size()
    total = min(max(2 * llc_bytes(), 64 << 20), 1 << 30)
    return [torch.empty(N, K, dtype=dt).fill_(0.01) for _ in range(max(2, -(-total // one)))]


def rotating(ws: list, fn):
    """fn(w) on the next weight of ws at each call."""
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(ws)
        return fn(ws[i[0]])
    return call
