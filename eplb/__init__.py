"""Expert-parallel load balancing: the pure planning algorithm (and, elsewhere in this package,
the load recorder, placement state and weight rebalancer)."""

from eplb.algorithm import balancedness, moved_slots, rebalance_experts

__all__ = ["rebalance_experts", "balancedness", "moved_slots"]
