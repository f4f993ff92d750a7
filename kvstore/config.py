"""The run config's [kv_cache] section: the tiers below each rank's device cache, and how the front
routes requests to the ranks that hold their prompt's prefix. Frozen, validated once.

    tiers               [] (device only) | ["host"] | ["host", "disk"]: where full blocks evicted from
                        the device cache go (host memory, pinned on CUDA; then files in disk_dir)
    host_bytes          host tier capacity per rank (preallocated)
    disk_bytes          disk tier capacity per rank
    disk_dir            the disk tier's directory (required with "disk"); a subdirectory per model
                        identity, one per rank inside it
    persist_on_close    on shutdown, write the device and host tiers' blocks to the disk tier
    routing             "kv_aware" (prefill tokens saved against load) | "least_loaded"
    route_prefix_weight cost per prompt token a rank already holds (subtracted)
    route_load_weight   cost per token in flight on a rank
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TIER_ORDERS = ((), ("host",), ("host", "disk"))
ROUTING = ("kv_aware", "least_loaded")


@dataclass(frozen=True)
class KVCacheConfig:
    tiers: tuple[str, ...] = ()
    host_bytes: int = 4 << 30
    disk_bytes: int = 64 << 30
    disk_dir: str | None = None
    persist_on_close: bool = True
    routing: str = "kv_aware"
    route_prefix_weight: float = 1.0
    route_load_weight: float = 0.25

    def __post_init__(self):
        if isinstance(self.tiers, str) or not isinstance(self.tiers, (list, tuple)):
            raise ValueError(f"kv_cache.tiers must be a list of tier names, got {self.tiers!r}")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if self.tiers not in TIER_ORDERS:
            raise ValueError(f"kv_cache.tiers must be one of {[list(t) for t in TIER_ORDERS]} (the disk tier sits "
                             f"below the host tier), got {list(self.tiers)}")
        for name in ("host_bytes", "disk_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"kv_cache.{name} must be an integer >= 1 (bytes), got {v!r}")
        if "disk" in self.tiers and (not isinstance(self.disk_dir, str) or not self.disk_dir):
            raise ValueError(f"kv_cache.tiers has \"disk\": kv_cache.disk_dir must name a directory, "
                             f"got {self.disk_dir!r}")
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            raise ValueError(f"kv_cache.disk_dir must be a directory path, got {self.disk_dir!r}")
        if not isinstance(self.persist_on_close, bool):
            raise ValueError(f"kv_cache.persist_on_close must be true or false, got {self.persist_on_close!r}")
        if self.routing not in ROUTING:
            raise ValueError(f"kv_cache.routing must be one of {ROUTING}, got {self.routing!r}")
        for name in ("route_prefix_weight", "route_load_weight"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"kv_cache.{name} must be a number >= 0, got {v!r}")

    @classmethod
    def coerce(cls, value: "KVCacheConfig | dict | None") -> "KVCacheConfig":
        """From itself, a dict of its fields (unknown keys: an error naming them), or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_cache must be a KVCacheConfig or a dict of its fields, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown kv_cache keys {unknown}; known: {sorted(known)}")
        return cls(**value)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
