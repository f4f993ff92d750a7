"""Prefill/decode disaggregation config: which ranks form which pool, and each pool's own sizes and
batch limits. Frozen, validated once on every rank before anything connects (same error everywhere).

    [disagg]              kv_transfer ("torch"), idle_sleep_s
    [disagg.prefill]      dp_size, ep_size, max_num_seqs, max_num_batched_tokens, kv_cache_blocks
    [disagg.decode]       dp_size, ep_size, max_num_seqs, max_num_batched_tokens, kv_cache_blocks

Ranks: the decode pool is ranks 0 .. D-1, the prefill pool D .. D+P-1. The front (rank 0) thus sits
in the decode pool, whose steps are short: it stays responsive while a long prompt is prefilled.
Inside a pool attention is data-parallel and experts expert-parallel over the pool (dp = ep = pool
size, as in the colocated runtime), with the pool's own process groups.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from wideep.parallel.expert_layout import ExpertLayout

KV_TRANSFER_BACKENDS = ("torch", "nixl", "mooncake")
_POOL_KEYS = ("dp_size", "ep_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_blocks")


@dataclass(frozen=True)
class PoolConfig:
    dp_size: int = 1
    ep_size: int | None = None          # None: dp_size (experts over every rank of the pool)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_blocks: int | None = None  # None: the engine's default sizing

    def __post_init__(self):
        if self.ep_size is None:
            object.__setattr__(self, "ep_size", self.dp_size)

    def check(self, name: str) -> None:
        for key in ("dp_size", "ep_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"disagg.{name}.{key} must be an integer >= 1, got {v!r}")
        kb = self.kv_cache_blocks
        if kb is not None and (not isinstance(kb, int) or isinstance(kb, bool) or kb < 1):
            raise ValueError(f"disagg.{name}.kv_cache_blocks must be an integer >= 1, got {kb!r}")
        if self.ep_size != self.dp_size:
            raise ValueError(f"disagg.{name}.ep_size ({self.ep_size}) != disagg.{name}.dp_size ({self.dp_size}): "
                             f"experts are spread over every rank of the pool")

    def engine_options(self) -> dict:
        out = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}
        if self.kv_cache_blocks is not None:
            out["kv_cache_blocks"] = self.kv_cache_blocks
        return out


@dataclass(frozen=True)
class DisaggConfig:
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    kv_transfer: str = "torch"       # "torch" (gloo / NCCL point-to-point); "nixl" | "mooncake": see kv_transfer.py
    idle_sleep_s: float = 0.002      # a pool whose ranks all wait on KV transfers (no tokens) pauses this long

    def __post_init__(self):
        self.prefill.check("prefill")
        self.decode.check("decode")
        if self.kv_transfer not in KV_TRANSFER_BACKENDS:
            raise ValueError(f"disagg.kv_transfer must be one of {KV_TRANSFER_BACKENDS}, got {self.kv_transfer!r}")
        if not 0 <= self.idle_sleep_s <= 1:
            raise ValueError(f"disagg.idle_sleep_s must be in [0, 1], got {self.idle_sleep_s}")

    @property
    def world_size(self) -> int:
        return self.decode.dp_size + self.prefill.dp_size

    @property
    def decode_ranks(self) -> list[int]:
        return list(range(self.decode.dp_size))

    @property
    def prefill_ranks(self) -> list[int]:
        return list(range(self.decode.dp_size, self.world_size))

    def role_of(self, rank: int) -> str:
        return "decode" if rank < self.decode.dp_size else "prefill"

    def validate(self, world_size: int, n_routed_experts: int | None = None) -> None:
        """Raise ValueError naming the numbers if the pools cannot run on world_size ranks."""
        if world_size != self.world_size:
            raise ValueError(f"disagg.prefill.dp_size ({self.prefill.dp_size}) + disagg.decode.dp_size "
                             f"({self.decode.dp_size}) = {self.world_size} != world_size ({world_size})")
        if n_routed_experts is not None:
            for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
                ExpertLayout.check(n_routed_experts, pool.ep_size, what="n_routed_experts",
                                   ep_name=f"disagg.{name}.ep_size")

    @classmethod
    def from_dict(cls, d: dict) -> "DisaggConfig":
        """From the [disagg] section; unknown keys are an error that names them."""
        d = dict(d)
        known = {"prefill", "decode", "kv_transfer", "idle_sleep_s"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown disagg config keys {unknown}; known: {sorted(known)}")
        pools = {}
        for name in ("prefill", "decode"):
            body = d.pop(name, {})
            if isinstance(body, PoolConfig):
                pools[name] = body
                continue
            if not isinstance(body, dict):
                raise ValueError(f"disagg.{name} must be a table, got {body!r}")
            bad = sorted(set(body) - set(_POOL_KEYS))
            if bad:
                raise ValueError(f"unknown disagg.{name} keys {bad}; known: {sorted(_POOL_KEYS)}")
            pools[name] = PoolConfig(**body)
        return cls(**pools, **d)

    @classmethod
    def coerce(cls, value) -> "DisaggConfig":
        return value if isinstance(value, DisaggConfig) else cls.from_dict(value or {})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
