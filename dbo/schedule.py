"""Overlap as data: a model step is a list of operations with YIELD markers; a plain step runs the
list in order, a split step runs two microbatches through it so that one's communication is in
flight while the other computes. The list is the model's only forward (engine/model/model.py builds it
from its layers' operations), so both kinds of step run the same code.

An operation is a function of one microbatch's state (state.py: an OpState that refuses
overwrites and reports leftovers). YIELD marks where a microbatch has started a transfer and has
nothing to do until it lands; the executor then switches to the other microbatch. Microbatch 0
always runs first, so with a layer written as

    attn, gate, dispatch_start, YIELD, shared_experts, dispatch_wait + experts + combine_start, YIELD,
    combine_wait, (next layer) ...

the step runs: attn/gate/dispatch(0) | attn/gate/dispatch(1) | experts(0) | experts(1) | combine(0) +
next layer's attn/gate/dispatch(0) | ... — DeepSeek's decode pipeline. Every rank executes the
same sequence of collectives in the same order, whatever its token counts (zero included).
"""
from __future__ import annotations

from typing import Any, Callable

Op = Callable[[Any], Any]


class _Yield:
    def __repr__(self) -> str:
        return "YIELD"


YIELD = _Yield()


def run_overlapped(ops: list[Op | _Yield], states: list) -> list:
    """Run `ops` on each state, switching between states at every YIELD (round-robin, state 0
    first). With one state it is a plain sequential run. -> the states."""
    if len({id(s) for s in states}) != len(states):
        raise ValueError("each microbatch needs its own state object; one was passed twice")
    pcs = [0] * len(states)
    live = list(range(len(states)))
    while live:
        for i in list(live):
            pc = pcs[i]
            while pc < len(ops) and ops[pc] is not YIELD:
                ops[pc](states[i])
                pc += 1
            pcs[i] = pc + 1  # past the YIELD (or past the end)
            if pcs[i] > len(ops):
                live.remove(i)
    return states


def run_sequential(ops: list[Op | _Yield], state):
    for op in ops:
        if op is not YIELD:
            op(state)
    return state
