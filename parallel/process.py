"""Whether a process seen by pid is still the process it was: evidence of death on one host."""
from __future__ import annotations

import os


def process_ident() -> str:
    """'<kernel boot id>/<pid namespace>/<pid>/<start time>': equal prefixes mean a pid seen here
    names the same process there; the start time tells a reused pid apart. '' off Linux."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
        return f"{boot}/{ns}/{os.getpid()}/{_start_time(os.getpid())}"
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if rest[0] in ("Z", "X") else rest[19]


def process_gone(ident: str, mine: str) -> bool:
    """True only on evidence: the process ident names shares this host's pid space and is not
    running (or its pid now belongs to another process)."""
    if not ident or not mine or ident.rsplit("/", 2)[0] != mine.rsplit("/", 2)[0]:
        return False
    pid, start = ident.rsplit("/", 2)[1:]
    return _start_time(int(pid)) != start
