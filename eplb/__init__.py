"""Expert-parallel load balancing: the pure planning algorithm (algorithm.py), the placement state
and hot-path map (placement.py), the load recorder (recorder.py), the weight moves (transfer.py,
rebalancer.py) and the per-rank controller the engine calls once per step (controller.py)."""

from wideep.eplb.algorithm import balancedness, moved_slots, rebalance_experts
from wideep.eplb.config import EplbConfig
from wideep.eplb.controller import EplbController
from wideep.eplb.placement import ExpertMap, Placement
from wideep.eplb.recorder import LoadRecorder

__all__ = ["rebalance_experts", "balancedness", "moved_slots", "EplbConfig", "EplbController", "ExpertMap",
           "Placement", "LoadRecorder"]
