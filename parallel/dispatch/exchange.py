"""One all-to-all round of the torch dispatchers (flat and two-level), with the simulated network,
and the format a row's expert slots travel in (metadata).

A round is one or more all_to_all_single calls issued together (payload and metadata, say) that
the simulated network (parallel/comm_stream.py SimulatedNetwork) delivers as one transfer with
`intra` bytes to other ranks of this node and `inter` bytes to other nodes (None: the round talks
to no rank of that tier, so that tier's latency is not paid).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm_stream import CommStream, SimulatedLink, SimulatedNetwork
from ..watchdog import guard_collective
from .base import Dispatcher

# (recv, send, recv_splits, send_splits): all_to_all_single's arguments; splits None = equal parts
Pair = tuple[Tensor, Tensor, "list[int] | None", "list[int] | None"]


def exchange(ctx, group, net: SimulatedNetwork | None, pairs: list[Pair], intra: int | None, inter: int | None,
             blocking: bool) -> tuple[list, Callable[[], None] | None]:
    """Issue the round. Blocking: wait for it and for the network, -> ([], None). Async: -> the
    works and `deliver`, to call after waiting them (None without a network)."""
    with guard_collective(ctx):
        works = [dist.all_to_all_single(recv, send, rs, ss, group=group, async_op=not blocking)
                 for recv, send, rs, ss in pairs]
    if blocking:
        if net is not None:
            SimulatedLink.wait_until(net.ready_at(intra, inter))
        return [], None
    return works, net.track(works, intra, inter) if net is not None else None


def tiers_used(nodes) -> tuple[bool, bool]:
    """(whether an all-to-all over the whole EP group talks to other ranks of this node, to other
    nodes): nodes is a parallel.dispatch.nodes.NodeLayout."""
    return nodes.ranks_per_node > 1, nodes.num_nodes > 1


def per_tier(used: tuple[bool, bool], intra: int, inter: int) -> tuple[int | None, int | None]:
    """Bytes per tier for the network, None for a tier the round does not use."""
    return (intra if used[0] else None), (inter if used[1] else None)


# -- how a row's expert slots travel -----------------------------------------------------------------
def pack_meta(ids: Tensor, weights: Tensor) -> Tensor:
    """ids [..., k] (-1 = no slot here), weights [..., k] -> [..., 2k] int32: the ids, then the
    weights' fp32 bit patterns, so that one int32 message carries both."""
    return torch.cat([ids.to(torch.int32), weights.float().contiguous().view(torch.int32)], dim=-1)


def unpack_meta(meta: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """[..., 2k] int32 -> ids [..., k] int64, weights [..., k] fp32."""
    return meta[..., :k].long(), meta[..., k:].contiguous().view(torch.float32)


def with_meta(x: Tensor, meta: Tensor) -> Tensor:
    """Rows x [..., H] and their meta [..., 2k] int32 -> one block [..., H + M] in x's dtype (the
    padded modes send one message). Needs an element size dividing 4 (fp32, bf16, fp16)."""
    if 4 % x.element_size():
        raise ValueError(f"low-latency dispatch packs int32 metadata into {x.dtype} rows; use normal mode")
    return torch.cat([x, meta.contiguous().view(x.dtype)], dim=-1)


def padded_blocks(x: Tensor, slots: Tensor, weights: Tensor, C: int) -> Tensor:
    """The padded modes' send buffer: x [T, H], per destination g the ids slots [G, T, k] (-1 = no
    slot there) and weights [G, T, k] -> [G, C, H + M], token t in row t of every block, the rows
    past T zero with ids -1. The caller has checked T <= C."""
    G, T, k = slots.shape
    ids = torch.full((G, C, k), -1, dtype=torch.long, device=x.device)
    ids[:, :T] = slots
    w = torch.zeros(G, C, k, device=x.device)
    w[:, :T] = weights
    rows = x.new_zeros(C, x.shape[1])
    rows[:T] = x
    return with_meta(rows.expand(G, C, x.shape[1]), pack_meta(ids, w))


def sum_members(parts: Tensor, member: Tensor, dtype: torch.dtype) -> Tensor:
    """parts [G, T, H] (a padded mode's returned blocks), member [T, G] (whether token t went to g)
    -> [T, H] in dtype: each token's partial sums from the blocks it went to (the others hold padding)."""
    return torch.where(member.t()[:, :, None], parts, 0).sum(0).to(dtype)


def split_rows(rows: Tensor, hidden: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """[R, H + M] from with_meta -> x [R, H], ids [R, k], weights [R, k]."""
    ids, w = unpack_meta(rows[:, hidden:].contiguous().view(torch.int32), k)
    return rows[:, :hidden].contiguous(), ids, w


class ExchangeDispatcher(Dispatcher):
    """What the flat and two-level torch dispatchers share: their process group, communication
    thread, simulated network and low-latency threshold. group: the process group (default
    ctx.ep_group); stream: run exchanges off the compute thread; link: a simulated network, or one
    SimulatedLink for every tier (testing), fixed for the dispatcher's life (`link` is read-only: a
    different network is a different dispatcher, and its microbatch copies share it);
    low_latency_max_tokens: steps planned with at most this many tokens per rank use the padded
    mode (0: never)."""

    supports_comm_stream = True
    microbatch_groups = True

    def __init__(self, ctx, num_physical_experts: int, hidden: int, *, group=None,
                 stream: CommStream | None = None, link: SimulatedLink | SimulatedNetwork | None = None,
                 low_latency_max_tokens: int = 0):
        super().__init__(ctx, num_physical_experts, hidden)
        self.group = group if group is not None else ctx.ep_group
        self.stream, self._link = stream, SimulatedNetwork.of(link)
        self.low_latency_max_tokens = low_latency_max_tokens
        self.tiers = tiers_used(self.nodes)

    @property
    def link(self) -> SimulatedNetwork | None:
        return self._link

    def for_microbatch(self, group, stream) -> "ExchangeDispatcher":
        return type(self)(self.ctx, self.num_physical_experts, self.hidden, group=group, stream=stream,
                          link=self.link, low_latency_max_tokens=self.low_latency_max_tokens)
