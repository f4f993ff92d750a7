"""Benchmark results: bench/results/<name>.json, one file per benchmark, written only when the run is recorded.

Each benchmark calls save(name, result) with the dict it prints as its last line; the file is that
dict plus the conditions of the run (META): the commit it ran on ("-dirty" when tracked files had
uncommitted changes), the command (argv), the date (UTC) and the machine (cores, CPU model, its ISA flags, the
native kernels' build and where they run instead of torch, load average when the run ended: the machine may be
shared, and the load says how much).
A run is recorded into bench/results/ (the files bench/summary.py builds the README's table from) with --record on
any benchmark's command line (taken out before the benchmark parses its arguments) or WIDEEP_BENCH_RECORD=1; any
other run writes to $WIDEEP_BENCH_DIR (default: <tmp>/wideep-bench), leaving the recorded files alone.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

META = ("commit", "command", "date", "machine")
RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
RECORD = "--record" in sys.argv[1:] or os.environ.get("WIDEEP_BENCH_RECORD", "0") not in ("", "0")
if "--record" in sys.argv[1:]:   # every benchmark takes it: out of the way of its own argument parser
    sys.argv[1:] = [a for a in sys.argv[1:] if a != "--record"]


def scratch() -> Path:
    """Where an unrecorded run's files go."""
    import tempfile
    return Path(os.environ.get("WIDEEP_BENCH_DIR") or Path(tempfile.gettempdir()) / "wideep-bench")


def commit(repo: Path = REPO) -> str:
    """Short HEAD hash, "-dirty" if tracked files other than the results themselves differ from it (a
    series of benchmarks rewrites bench/results/ as it goes; that is not a change to the code that ran);
    "unknown" outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return "unknown"
    dirty = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)bench/results").returncode != 0
    return head.stdout.strip() + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernels() -> dict | None:
    """The ISA paths the run took: the native kernels' build (-march), their run-time switches (AVX512-BF16 dot
    products, AMX tiles), torch's CPU capability and where the C kernels ran instead of torch (cpu/tune.py), when
    the run loaded them; None when it did not."""
    build = sys.modules.get("wideep.cpu.build")
    if build is None or build._lib is None:
        return None
    import torch
    from wideep.cpu import gemm, tune
    c = tune.choices()
    return {"march": build.march(), "bf16_dot": gemm.bf16_dot(), "amx": gemm.amx_on(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "limits": c["limits"],
            "limits_measured": c["measured"]}


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (None, None, None)
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "asimd", "sve", "bf16")
           if f in flags]
    out = {"nproc": os.cpu_count(), "cpu_model": cpu_model(), "isa": isa, "platform": platform.platform(),
           "python": platform.python_version(),
           "load_avg_1_5_15m": [round(x, 2) if x is not None else None for x in load]}
    k = kernels()
    if k is not None:
        out["kernels"] = k
    return out


def rss_kib() -> int:
    """This process's resident set (VmRSS), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def command(argv: list[str] | None = None) -> str:
    """The argv as a reader would type it: `python bench/x.py --flag`, the script relative to the repo."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0]).resolve()
        if script.is_relative_to(REPO):
            argv[0] = script.relative_to(REPO).as_posix()
    return " ".join(["python", *argv])


def save(name: str, result: dict, directory: Path | None = None) -> Path:
    """Writes <directory>/<name>.json (default: bench/results when the run is recorded, else scratch()) -> its
    path. Prints the path to stderr only, so a benchmark's stdout still ends with its JSON line."""
    clash = sorted(set(META) & set(result))
    if clash:
        raise ValueError(f"{name}: result keys {clash} are the run's conditions (bench/results.py META)")
    out = Path(directory) if directory is not None else RESULTS if RECORD else scratch()
    out.mkdir(parents=True, exist_ok=True)
    record = {**result, "commit": commit(), "command": command(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": machine()}
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path}", file=sys.stderr, flush=True)
    return path
