"""What one microbatch carries between the operations of a model step (see schedule.py).

    s = OpState(Microbatch(index, input_ids, meta, kv_pools, plan, dispatcher, on_layer))
    s.put(h=h, y=y)          # a value for a later operation; setting a name already set fails
    y = s.take("y")          # read and remove; a name not set (by this microbatch) fails
    y = s.peek("y")          # read, leave it for another operation
    s.end_layer(i, carry=("x", "rope"))   # anything else still set is a bug: it fails, naming it
    out = s.result("hidden")              # the end: take the result, nothing else may be left

Each microbatch has its own OpState, bound to its own Microbatch (inputs that do not change during
the step: its tokens, attention metadata, its dispatcher, the step's plan). With a bare dict a
stage can silently read a value another microbatch, or an earlier layer, left behind; here that
value either is not there (take fails) or is still there when the layer ends (end_layer fails),
and writing over a value nobody consumed fails at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from wideep.attention_mla.meta import AttnMeta
    from wideep.parallel.dispatch import Dispatcher
    from wideep.parallel.step_plan import StepPlan


class OpStateError(RuntimeError):
    """An operation list passed values between its stages wrongly (a bug in the list, not in the data)."""


@dataclass(frozen=True)
class Microbatch:
    """One microbatch's inputs (the whole step when not split). T tokens of this microbatch."""
    index: int                           # 0 for a plain step; 0 / 1 for the halves of a split step
    input_ids: "torch.Tensor | None"     # [T]
    meta: "AttnMeta | None"              # positions, slots, block tables of these T tokens
    kv_pools: list                       # per layer [S, C+R] latent pools (shared by the microbatches)
    plan: "StepPlan"                     # the step's plan, the same on every rank
    dispatcher: "Dispatcher | None"      # this microbatch's MoE dispatcher
    on_layer: Callable[[int], None] | None = None   # called once layer i's latents are in kv_pools[i]
    index_pools: list | None = None      # DSA: per layer [S, Dk] indexer keys, slot for slot with kv_pools


class OpState:
    def __init__(self, inputs: Microbatch, **values: Any):
        self.inputs = inputs
        self._values: dict[str, Any] = {}
        self.put(**values)

    def _where(self) -> str:
        return f"microbatch {self.inputs.index}"

    def put(self, **values: Any) -> None:
        for name, v in values.items():
            if name in self._values:
                raise OpStateError(f"{self._where()}: {name!r} is set again before anything took it "
                                   f"(set: {sorted(self._values)})")
            self._values[name] = v

    def take(self, name: str) -> Any:
        if name not in self._values:
            raise OpStateError(f"{self._where()}: {name!r} was not set by this microbatch's earlier "
                               f"operations (set: {sorted(self._values)})")
        return self._values.pop(name)

    def peek(self, name: str) -> Any:
        if name not in self._values:
            raise OpStateError(f"{self._where()}: {name!r} was not set by this microbatch's earlier "
                               f"operations (set: {sorted(self._values)})")
        return self._values[name]

    def end_layer(self, layer: int, carry: tuple[str, ...]) -> None:
        """The end of layer `layer`: only the `carry` names (the next layer's inputs) may be left."""
        left = sorted(set(self._values) - set(carry))
        if left:
            raise OpStateError(f"{self._where()}: layer {layer} ended with {left} set and never taken")
        missing = sorted(set(carry) - set(self._values))
        if missing:
            raise OpStateError(f"{self._where()}: layer {layer} ended without {missing}")

    def result(self, name: str) -> Any:
        """The end of the operation list: -> `name`'s value; anything else still set fails."""
        value = self.take(name)
        if self._values:
            raise OpStateError(f"{self._where()}: the operations ended with {sorted(self._values)} set and never taken")
        return value
