"""The routed experts' placement as the MoE layers read it: given to each layer at construction, and
updated in place, between steps, by whoever moves experts (EPLB's rebalance, re-forming after a lost
rank) — the layers never have it set on them (vLLM's EplbState, which the layers hold views of).

Legend: L MoE layers, k this rank's physical slots per layer, P physical slots (all ranks).
    routing.layers[l].local_phy2log  [k] logical expert each of this rank's slots holds
    routing.layers[l].expert_map     logical ids [T, k] -> physical ids (None: the identity)
    routing.layers[l].load_counts    [P] int64 the layer's route adds its physical ids into (None: off)
    routing.placement                the placement installed last (eplb.placement.Placement, [L, P]; None: the
                                     identity of the constructor)
"""
from __future__ import annotations


class LayerRouting:
    __slots__ = ("local_phy2log", "expert_map", "load_counts")

    def __init__(self, local_phy2log: list[int]):
        self.local_phy2log = list(local_phy2log)
        self.expert_map = None
        self.load_counts = None


class ExpertRouting:
    def __init__(self, num_layers: int, local_phy2log: list[int]):
        """Every layer starts with the same local slots (the contiguous identity until a placement)."""
        self.num_local = len(local_phy2log)
        self.layers = [LayerRouting(local_phy2log) for _ in range(num_layers)]
        self.placement = None

    def set_placement(self, layer: int, local_phy2log: list[int], expert_map=None) -> None:
        """Which logical expert each local slot of `layer` holds ([k]) and the map its router's ids go
        through. The caller swaps the slots' weights at the same step."""
        if len(local_phy2log) != self.num_local:
            raise ValueError(f"{len(local_phy2log)} local slots given for MoE layer {layer}, this rank has "
                             f"{self.num_local}")
        r = self.layers[layer]
        r.local_phy2log, r.expert_map = list(local_phy2log), expert_map

    def placed(self, placement) -> None:
        """Every layer now follows `placement` (set_placement was called for each): remember it whole."""
        self.placement = placement

    def resize(self, num_local: int) -> None:
        """The rank now holds num_local slots per layer (re-forming after a lost rank); set_placement follows."""
        self.num_local = num_local

    def record_into(self, counts) -> None:
        """counts: one [P] int64 tensor per layer to add routed ids into (EPLB's recorder), or None: stop."""
        for l, r in enumerate(self.layers):
            r.load_counts = None if counts is None else counts[l]
