"""What a cluster made, on disk before it is made, so that `wideep cluster down` can remove it after
the process that made it was killed.

One JSON file per cluster in STATE_DIR (/run: a tmpfs, emptied at boot like the namespaces it
describes), named by the cluster's prefix. A file names every namespace and the one root-namespace
link the cluster makes; `down` removes exactly those names, never anything matched by pattern.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
from contextlib import contextmanager

STATE_DIR = os.environ.get("WIDEEP_CLUSTER_STATE_DIR", "/run/wideep-cluster")


def path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"{prefix}.json")


@contextmanager
def locked():
    """Holds the state directory's lock: two `up`s at once never pick the same prefix or subnet."""
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def all_states() -> list[dict]:
    """Every recorded cluster (files that do not parse are skipped: a write cut off by a kill)."""
    if not os.path.isdir(STATE_DIR):
        return []
    out = []
    for name in sorted(os.listdir(STATE_DIR)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(STATE_DIR, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return out


def load(prefix: str) -> dict:
    try:
        with open(path(prefix)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no cluster with prefix {prefix!r} is recorded in {STATE_DIR}") from None


def save(state: dict) -> None:
    """Written whole to a temporary name, then renamed: a kill leaves the old file or the new one."""
    tmp = path(state["prefix"]) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path(state["prefix"]))


def remove(prefix: str) -> None:
    try:
        os.remove(path(prefix))
    except FileNotFoundError:
        pass


def draw_prefix(taken: set[str]) -> str:
    """A fresh prefix ("wd" + 4 hex digits): unique per run, so a test's cluster never meets a
    developer's, and short enough for a link name (15 characters) with a suffix."""
    while True:
        p = "wd" + secrets.token_hex(2)
        if p not in taken:
            return p


def owner_alive(state: dict) -> bool:
    """Whether the process that made the cluster (None: `wideep cluster up`, which outlives its
    command by design) still runs."""
    pid = state.get("owner_pid")
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
