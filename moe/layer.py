"""MoE layer: gate -> dispatch -> local experts -> combine, + shared experts, as overlap operations.

Legend: T tokens on this rank, H hidden, k top-k, P physical experts (all ranks), El local experts.
The gate's logical ids become physical ids through `routing.expert_map` (EPLB's placement, which may
hold several replicas of a hot expert; None = identity). The microbatch's dispatcher (parallel.dispatch;
LocalDispatcher on one EP rank) moves each token once to every rank holding one of its experts and
brings the weighted sums back. `routing.load_counts` ([P] int64, EPLB's recorder), when set, gets the
step's physical ids added in place: no host sync. `routing` (parallel/expert_routing.py) is given at
construction and updated in place by EPLB; the layer only reads it.

The layer's forward is its operation list (ops(); dbo/schedule.py): the model runs it in order for
a plain step and interleaved with another microbatch's for a DBO step. State names (dbo/state.py):

    mlp_in [T, H]  ->  route: topk_ids, topk_weights [T, k] (physical)
                   ->  dispatch_start: dispatching                         | YIELD
    shared_experts: shared_out [T, H] | None  ->  dispatch_wait: dispatched
                   ->  experts: expert_out [R, H], handle  ->  combine_start: combining   | YIELD
    combine_wait   ->  mlp_out [T, H]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from wideep.dbo.schedule import YIELD, run_sequential
from wideep.dbo.state import Microbatch, OpState
from wideep.layers import MLP, NATIVE, Kernels
from wideep.parallel.expert_layout import ExpertLayout
from wideep.parallel.expert_routing import LayerRouting
from wideep.parallel.step_plan import StepPlan

from .config import MoEConfig
from .experts import Experts
from .gate import Gate


@dataclass(frozen=True)
class ExpertShard:
    """This rank's contiguous slice of the P physical experts: [first, first + num_local)."""

    num_physical: int
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self):
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank ({self.ep_rank}) must be in [0, ep_size ({self.ep_size}))")
        ExpertLayout.check(self.num_physical, self.ep_size)

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.num_physical, self.ep_size)

    @property
    def num_local(self) -> int:
        return self.layout.per_rank

    @property
    def first(self) -> int:
        return self.layout.first(self.ep_rank)


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, shard: ExpertShard | None = None, device=None, dtype=None,
                 fp8_block: tuple[int, int] | None = None, linear=nn.Linear, experts_backend: str = "grouped",
                 deepgemm=None, kernels: Kernels = NATIVE, routing: LayerRouting | None = None,
                 hash_vocab: int | None = None, fp4_experts: bool = False):
        """fp8_block: routed experts keep fp8 weights in these blocks; linear: the shared experts' class;
        experts_backend, deepgemm: the routed experts' forward (moe/experts.py; resolved by moe/backend.py);
        kernels: the backend's table (layers/kernels.py) for the router and the experts. routing: this
        layer's placement and load counters (the model's ExpertRouting; default: the identity, not recording).
        hash_vocab: the gate routes by token id (moe/gate.py; the microbatch's input_ids travel to it).
        fp4_experts: the routed experts keep FP4 weights as stored (moe/experts.py fp4)."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard or ExpertShard(cfg.n_routed_experts)
        self.gate = Gate(cfg, device=device, kernels=kernels, hash_vocab=hash_vocab)
        self.experts = Experts(self.shard.num_local, cfg.hidden_size, cfg.moe_intermediate_size,
                               device=device, dtype=dtype, fp8_block=fp8_block, backend=experts_backend,
                               deepgemm=deepgemm, kernels=kernels, limit=cfg.swiglu_limit, fp4=fp4_experts)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                   device=device, dtype=dtype, linear=linear, limit=cfg.swiglu_limit)
                               if cfg.n_shared_experts else None)
        self.routing = routing or LayerRouting(self.shard.layout.slots(self.shard.ep_rank))

    @property
    def local_phy2log(self) -> list[int]:
        """[El] the logical expert each local slot holds (contiguous identity until EPLB)."""
        return self.routing.local_phy2log

    @property
    def expert_map(self):
        """logical ids [T, k] -> physical ids [T, k]; None = identity."""
        return self.routing.expert_map

    @property
    def load_counts(self):
        """[P] int64 tokens per physical slot, added in place by route(); None = not recording."""
        return self.routing.load_counts

    def use_experts(self, experts: Experts, shard: ExpertShard) -> None:
        """This rank's routed experts after a re-layout (recovery after a lost rank): `experts` holds `shard`'s
        slots, already filled; the routing the layer reads is set by whoever re-laid them."""
        self.experts, self.shard = experts, shard

    @torch.no_grad()
    def copy_local_replicas(self) -> None:
        """Slots holding an expert this rank already holds in an earlier slot (one EP rank with
        redundant slots) get that slot's weights; the checkpoint is read into the first only."""
        first: dict[int, int] = {}
        for slot, e in enumerate(self.local_phy2log):
            if e in first:
                for p in self.experts.parameters():
                    p.data[slot] = p.data[first[e]]
            first.setdefault(e, slot)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (, input_ids [T]: a hash-routed gate's) -> physical topk_ids [T, k], topk_weights [T, k]
        (recorded for EPLB when on, hash layers too)."""
        topk_ids, topk_weights = (self.gate(x) if self.gate.tid2eid is None
                                  else self.gate(x, input_ids))                # [T, k] logical
        r = self.routing
        if r.expert_map is not None:
            topk_ids = r.expert_map(topk_ids)                                  # [T, k] physical
        if r.load_counts is not None:
            flat = topk_ids.reshape(-1)
            r.load_counts.index_add_(0, flat, torch.ones_like(flat))
        return topk_ids, topk_weights

    # -- operations (see the module doc for the state names) ----------------------------------------
    def ops(self) -> list:
        return [self.op_route, self.op_dispatch_start, YIELD,
                # shared experts first: they fill the time the dispatch may still need
                self.op_shared_experts, self.op_dispatch_wait, self.op_experts, self.op_combine_start, YIELD,
                self.op_combine_wait]

    def op_route(self, s: OpState) -> None:
        topk_ids, topk_weights = self.route(s.peek("mlp_in"), s.inputs.input_ids)
        s.put(topk_ids=topk_ids, topk_weights=topk_weights)

    def op_dispatch_start(self, s: OpState) -> None:
        mb = s.inputs
        s.put(dispatching=mb.dispatcher.dispatch_start(s.peek("mlp_in"), s.take("topk_ids"), s.take("topk_weights"),
                                                       mb.plan))

    def op_shared_experts(self, s: OpState) -> None:
        x = s.take("mlp_in")
        s.put(shared_out=self.shared_experts(x) if self.shared_experts is not None else None)

    def op_dispatch_wait(self, s: OpState) -> None:
        s.put(dispatched=s.take("dispatching").wait())

    def op_experts(self, s: OpState) -> None:
        d = s.take("dispatched")                                               # local ids
        s.put(expert_out=self.experts(d.x, d.topk_ids, d.topk_weights), handle=d.handle)

    def op_combine_start(self, s: OpState) -> None:
        s.put(combining=s.inputs.dispatcher.combine_start(s.take("expert_out"), s.take("handle")))

    def op_combine_wait(self, s: OpState) -> None:
        out, shared = s.take("combining").wait(), s.take("shared_out")
        s.put(mlp_out=out if shared is None else out + shared)

    def forward(self, x: torch.Tensor, dispatcher=None, plan: StepPlan = StepPlan()) -> torch.Tensor:
        """x [T, H] -> [T, H]: ops() in order. dispatcher: the EP group's (default: this layer on its
        own, every expert local, which needs a one-rank shard)."""
        if dispatcher is None:
            from wideep.parallel.context import ParallelContext
            from wideep.parallel.dispatch import LocalDispatcher
            if self.shard.ep_size != 1:
                raise ValueError(f"an MoE layer with ep_size {self.shard.ep_size} needs its EP group's dispatcher")
            dispatcher = LocalDispatcher(ParallelContext.single(x.device), self.shard.num_physical, self.cfg.hidden_size)
        s = OpState(Microbatch(0, None, None, [], plan, dispatcher), mlp_in=x)
        return run_sequential(self.ops(), s).result("mlp_out")
