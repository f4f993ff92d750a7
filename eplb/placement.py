"""Where every logical expert lives: the placement state and the hot-path logical->physical map.

Legend: L MoE layers, E logical experts, P physical slots per layer (E + redundant), M most
replicas of one expert, ep EP ranks, k = P / ep. Physical slots [r*k, (r+1)*k) live on EP rank r
(parallel.ExpertLayout, the dispatchers' layout); a placement only says which logical expert each
slot holds.

    phy2log [L, P]    logical expert held by each physical slot
    log2phy [L, E, M] physical slots of each logical expert, ascending, -1 padded
    logcnt  [L, E]    replicas of each logical expert (>= 1)

A placement file is JSON {"phy2log": [[...], ...]} ([L, P]); other keys are ignored, so the output
of `wideep eplb-plan` is one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from wideep.eplb.algorithm import _invert
from wideep.parallel.expert_layout import ExpertLayout


def read_json(path: str, what: str):
    """A JSON file, with errors that name `what` and the path."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class Placement:
    phy2log: torch.Tensor   # [L, P] int64, CPU
    log2phy: torch.Tensor   # [L, E, M] int64, CPU
    logcnt: torch.Tensor    # [L, E] int64, CPU

    @classmethod
    def from_phy2log(cls, phy2log, num_experts: int) -> "Placement":
        """Validate phy2log ([L, P], logical ids) and derive log2phy/logcnt."""
        p = torch.as_tensor(phy2log, dtype=torch.int64).cpu().contiguous()
        if p.dim() != 2 or p.shape[1] < num_experts:
            raise ValueError(f"phy2log must be [moe_layers, physical >= {num_experts}], got {list(p.shape)}")
        if p.numel() and (p.min() < 0 or p.max() >= num_experts):
            raise ValueError(f"phy2log ids must lie in [0, {num_experts}), got "
                             f"[{int(p.min())}, {int(p.max())}]")
        log2phy, logcnt = _invert(p, num_experts)
        missing = (logcnt == 0).nonzero()
        if len(missing):
            l, e = missing[0].tolist()
            raise ValueError(f"phy2log leaves {len(missing)} logical experts without a slot "
                             f"(first: layer {l}, expert {e}); every expert needs >= 1 replica")
        return cls(p, log2phy, logcnt)

    @classmethod
    def initial(cls, num_layers: int, num_experts: int, num_physical: int) -> "Placement":
        """Slot p holds expert p % E: the identity without redundancy; the redundant slots (on the
        last ranks) replicate experts 0, 1, ... round-robin."""
        row = torch.arange(num_physical) % num_experts
        return cls.from_phy2log(row.expand(num_layers, -1), num_experts)

    @classmethod
    def load(cls, path: str, num_layers: int, num_experts: int, num_physical: int) -> "Placement":
        """A placement file; its shape must be [num_layers, num_physical]."""
        data = read_json(path, "eplb.initial_placement")
        if not isinstance(data, dict) or "phy2log" not in data:
            raise ValueError(f"eplb.initial_placement {path!r} has no \"phy2log\" key")
        p = torch.tensor(data["phy2log"], dtype=torch.int64)
        if tuple(p.shape) != (num_layers, num_physical):
            raise ValueError(f"eplb.initial_placement {path!r}: phy2log is {list(p.shape)}, the model needs "
                             f"[moe_layers, physical slots] = [{num_layers}, {num_physical}]")
        try:
            return cls.from_phy2log(p, num_experts)
        except ValueError as e:
            raise ValueError(f"eplb.initial_placement {path!r}: {e}") from None

    def save(self, path: str, **extra) -> None:
        with open(path, "w") as f:
            json.dump({"phy2log": self.phy2log.tolist(), **extra}, f)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    def is_identity(self, layer: int) -> bool:
        return self.num_physical == self.num_experts and bool(
            (self.phy2log[layer] == torch.arange(self.num_physical)).all())

    def local(self, layer: int, ep_rank: int, ep_size: int) -> list[int]:
        """Logical expert of each of EP rank ep_rank's slots in `layer`: [k]."""
        slots = ExpertLayout(self.num_physical, ep_size).slots(ep_rank)
        return self.phy2log[layer, slots.start:slots.stop].tolist()

    def install(self, routing, ep_rank: int, ep_size: int, device) -> None:
        """Point the model's expert routing (parallel/expert_routing.py ExpertRouting, which every MoE
        layer reads) at this placement: each layer's local slot list and expert map (None, the identity,
        where the layer's placement is the identity), the map's tables on `device`. Moves nothing."""
        if len(routing.layers) != self.num_layers:
            raise ValueError(f"placement has {self.num_layers} MoE layers, the model {len(routing.layers)}")
        for l in range(self.num_layers):
            emap = None if self.is_identity(l) else ExpertMap(self.log2phy[l], self.logcnt[l], ep_rank, device)
            routing.set_placement(l, self.local(l, ep_rank, ep_size), emap)
        routing.placed(self)


class ExpertMap:
    """Logical -> physical expert ids of one MoE layer, on the device; replaced as a whole.

    The token in row t, top-k column j, routed to a logical expert with c replicas, goes to replica
    (t + j + offset) % c: no RNG and no host sync, consecutive tokens spread evenly over the
    replicas, and the per-rank offset keeps one-token decode steps of different ranks apart.
    """

    def __init__(self, log2phy: torch.Tensor, logcnt: torch.Tensor, offset: int, device):
        self.num_replicas_max = log2phy.shape[1]
        self.log2phy = log2phy.reshape(-1).to(device)      # [E*M]
        self.logcnt = logcnt.to(device)                    # [E]
        self.offset = offset

    def __call__(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, k] logical -> [T, k] physical."""
        M = self.num_replicas_max
        if M == 1:
            return self.log2phy[topk_ids]
        T, k = topk_ids.shape
        dev = topk_ids.device
        turn = torch.arange(T, device=dev)[:, None] + torch.arange(k, device=dev) + self.offset   # [T, k]
        return self.log2phy[topk_ids * M + turn % self.logcnt[topk_ids]]


def rank_load(load: torch.Tensor, phy2log: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Expected load per EP rank: [L, ep] float64 from load [L, E] and phy2log [L, P], a logical
    expert's load split evenly over its replicas (what the replica map does on average)."""
    w = torch.as_tensor(load).to("cpu", torch.float64)
    p = torch.as_tensor(phy2log).cpu()
    L, P = p.shape
    cnt = torch.zeros(L, w.shape[1], dtype=torch.float64).scatter_add_(1, p, torch.ones(L, P, dtype=torch.float64))
    return (w.gather(1, p) / cnt.gather(1, p)).view(L, ep_size, ExpertLayout(P, ep_size).per_rank).sum(-1)
