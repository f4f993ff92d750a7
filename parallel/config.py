"""How the ranks are laid out: sizes, backends, timeouts. Pure data, validated once.

Attention is data-parallel and tensor-parallel (dp_size * tp_size = world size); routed experts are
expert-parallel over all ranks (ep_size = world size). Only tp_size = 1 is implemented, so today
dp_size = ep_size = world size; the fields stay separate so attention TP can be added later.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .expert_layout import ExpertLayout

BACKENDS = ("auto", "gloo", "nccl")
DISPATCH_BACKENDS = ("auto", "torch", "hierarchical", "allgather", "deepep")


@dataclass(frozen=True)
class ParallelConfig:
    dp_size: int = 1
    ep_size: int = 1
    tp_size: int = 1
    backend: str = "auto"              # process-group backend: gloo on CPU, nccl on CUDA
    dispatch_backend: str = "auto"     # MoE all-to-all: auto = deepep when usable, else hierarchical with
                                       # more than one node, else torch
    num_redundant_experts: int = 0     # extra physical expert slots for EPLB replicas
    timeout_s: float = 60.0            # collectives, rendezvous; a silent rank is lost after this long
    heartbeat_s: float = 1.0           # watchdog beat period between ring neighbours
    ranks_per_node: int = 0            # 0 = from the launcher; > 0 simulates nodes of this many ranks
    on_rank_loss: str = "exit"         # "exit": every survivor exits naming the lost rank; "continue":
    #                                    the survivors re-form and serve on (parallel/reform.py)
    deepep_low_latency_max_tokens: int = 128  # decode batches up to this use DeepEP low-latency mode
    torch_low_latency_max_tokens: int = 64    # steps up to this many tokens per rank: padded one-message
                                              # torch all-to-all, no count exchange (0 = never)
    simulated_latency_us: float = 0.0  # testing: each torch all-to-all takes >= this + bytes / simulated_gbps
    simulated_gbps: float = 0.0        # 0 = no bandwidth term; these two: the intra-node tier (one node: all)
    simulated_inter_node_latency_us: float = 0.0   # the inter-node tier's (0 = as the intra-node tier)
    simulated_inter_node_gbps: float = 0.0

    def __post_init__(self):
        for name in ("dp_size", "ep_size", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dispatch_backend not in DISPATCH_BACKENDS:
            raise ValueError(f"dispatch_backend must be one of {DISPATCH_BACKENDS}, got {self.dispatch_backend!r}")
        if not isinstance(self.ranks_per_node, int) or isinstance(self.ranks_per_node, bool) or self.ranks_per_node < 0:
            raise ValueError(f"ranks_per_node must be an integer >= 0 (0 = from the launcher), got {self.ranks_per_node!r}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an integer >= 0, got {self.num_redundant_experts!r}")
        if self.on_rank_loss not in ("exit", "continue"):
            raise ValueError(f"on_rank_loss must be \"exit\" or \"continue\", got {self.on_rank_loss!r}")
        if not self.timeout_s > 0 or not self.heartbeat_s > 0:
            raise ValueError(f"timeout_s ({self.timeout_s}) and heartbeat_s ({self.heartbeat_s}) must be > 0")
        # A failure that surfaced in a collective must become a verdict (lost_after_s) and be acted on
        # (one more beat) within timeout_s.
        if self.lost_after_s + self.heartbeat_s > self.timeout_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) is too long for timeout_s ({self.timeout_s}): a lost rank is "
                f"declared after {self.lost_after_s:g} s; need lost_after_s + heartbeat_s <= timeout_s")
        bad = {f: getattr(self, f) for f in ("simulated_latency_us", "simulated_gbps", "simulated_inter_node_latency_us",
                                             "simulated_inter_node_gbps")
               if not isinstance(getattr(self, f), (int, float)) or isinstance(getattr(self, f), bool)
               or not getattr(self, f) >= 0}
        if bad:
            raise ValueError(f"simulated link settings must be numbers >= 0, got "
                             + ", ".join(f"{k} = {v!r}" for k, v in bad.items()))
        if self.deepep_low_latency_max_tokens < 1:
            raise ValueError(f"deepep_low_latency_max_tokens must be >= 1, got {self.deepep_low_latency_max_tokens}")
        if not isinstance(self.torch_low_latency_max_tokens, int) or self.torch_low_latency_max_tokens < 0:
            raise ValueError(f"torch_low_latency_max_tokens must be an integer >= 0, got "
                             f"{self.torch_low_latency_max_tokens!r}")

    @property
    def lost_after_s(self) -> float:
        """How long a rank whose collective or store call failed waits for the watchdog's verdict.
        A death is seen at once (closed connection) and a silent rank's timeout_s ran out before any
        collective waiting on it timed out, so a few beats are plenty; never less than 5 s (an
        overloaded host), never more than half the timeout. Not the silence threshold: that is
        timeout_s, slowness gets all of it."""
        return min(max(5.0, 5 * self.heartbeat_s), self.timeout_s / 2)

    def num_physical_experts(self, n_routed_experts: int) -> int:
        return n_routed_experts + self.num_redundant_experts

    def validate(self, world_size: int, n_routed_experts: int | None = None) -> None:
        """Raise ValueError naming the numbers if this layout cannot run on world_size ranks
        (and, when given, with n_routed_experts logical experts)."""
        if self.tp_size != 1:
            raise ValueError(f"attention tensor parallelism is not supported yet: tp_size ({self.tp_size}) must be 1")
        if self.dp_size * self.tp_size != world_size:
            if self.tp_size == 1:
                raise ValueError(
                    f"dp_size ({self.dp_size}) != world_size ({world_size}): each rank is one data-parallel rank; "
                    f"start {self.dp_size} ranks (torchrun --nproc-per-node {self.dp_size}, mpirun -n {self.dp_size}, "
                    f"or `wideep serve` without a launcher, which starts them itself) or leave dp_size out to use "
                    f"the {world_size} started")
            raise ValueError(f"dp_size ({self.dp_size}) * tp_size ({self.tp_size}) = "
                             f"{self.dp_size * self.tp_size} != world_size ({world_size})")
        if self.ranks_per_node and world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) does not divide world_size ({world_size})")
        if self.ep_size != world_size:
            raise ValueError(f"ep_size ({self.ep_size}) != world_size ({world_size}): routed experts are "
                             f"spread over every rank")
        if n_routed_experts is not None:
            ExpertLayout.check(self.num_physical_experts(n_routed_experts), self.ep_size,
                               what="n_routed_experts + num_redundant_experts")

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        """From a run-config section; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown parallel config keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
