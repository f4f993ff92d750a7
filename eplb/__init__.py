"""Expert-parallel load balancing: the pure planning algorithm (algorithm.py), the placement state
and hot-path map (placement.py), the load recorder (recorder.py), the weight moves (transfer.py,
rebalancer.py) and the per-rank controller the engine calls once per step (controller.py)."""

from eplb.algorithm import balancedness, moved_slots, rebalance_experts
from eplb.config import EplbConfig
from eplb.controller import EplbController
from eplb.placement import ExpertMap, Placement
from eplb.recorder import LoadRecorder

__all__ = ["rebalance_experts", "balancedness", "moved_slots", "EplbConfig", "EplbController", "ExpertMap",
           "Placement", "LoadRecorder"]
