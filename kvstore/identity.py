"""A model's identity for its KV blocks: what must be equal for a stored block to be reused.

identity = BLAKE2b(format version, config.json (canonical JSON), a fingerprint of the weight files,
the cache dtype, the block size, the per-block tensor layout). A disk tier keeps one directory per
identity and stamps it into every file, so a restart finds its own blocks and never another model's.

The weights fingerprint reads, per weight file: its name, size, safetensors header (names, dtypes,
shapes, offsets) and the bytes themselves — all of them up to WHOLE_FILE bytes, else SAMPLES chunks
of SAMPLE bytes spread evenly over the file (a few MB per file instead of the whole checkpoint).
Two checkpoints that differ only between the samples of a large file would share an identity; a
model whose weights are edited in place should use a fresh disk_dir.
"""
from __future__ import annotations

import hashlib
import json
import os

FORMAT_VERSION = 1
WHOLE_FILE = 64 << 20
SAMPLES, SAMPLE = 16, 64 << 10
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _file_fingerprint(path: str, h) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size}\n".encode())
    with open(path, "rb") as f:
        if path.endswith(".safetensors") and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, size - 8)))
        if size <= WHOLE_FILE:
            f.seek(0)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return
        for i in range(SAMPLES):
            f.seek((size - SAMPLE) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE))


def weights_fingerprint(model_dir: str) -> str:
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{model_dir!r} has no weight files ({', '.join(_WEIGHT_SUFFIXES)}) to fingerprint")
    h = hashlib.blake2b(digest_size=16)
    for name in files:
        _file_fingerprint(os.path.join(model_dir, name), h)
    return h.hexdigest()


def model_identity(model_dir: str, dtype: str, block_size: int, layout: list[tuple[int, ...]]) -> str:
    """-> 32 hex digits. layout: the shape of one block's rows in each tensor the store moves
    ([block_size, D] per layer, in order)."""
    weights = weights_fingerprint(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.dumps(json.load(f), sort_keys=True, separators=(",", ":"))
    h = hashlib.blake2b(digest_size=16)
    for part in (f"wideep-kv:{FORMAT_VERSION}", config, weights, dtype, str(block_size),
                 json.dumps([list(s) for s in layout])):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()
