"""Moving expert weights between EP ranks: which slots change (pure), and the point-to-point copy.

Legend: L MoE layers, P physical slots, ep EP ranks, k = P / ep slots per rank, n slots of this
rank that change in a layer, B bytes of one expert (all its stacked parameters).

plan_moves(old, new, ep) lists, per layer, each (destination rank, logical expert) pair whose slots
change: the expert's weights come from the destination itself when it already holds the expert
(a local copy), otherwise from one rank holding it today (holders take turns). Every rank computes
the same list from the same two placements, so sender and receiver agree without talking.

stage_layer() runs one layer's moves: one send and one receive buffer per peer pair
(batch_isend_irecv over the EP group, so NCCL gets them as one group), every expert's parameters
packed as raw bytes ([n, B] uint8, any dtype mix). Sources read their live weights, which do not
change until swap_layer(): a forward between staging and swapping sees the old placement whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from wideep.parallel.expert_layout import ExpertLayout
from wideep.parallel.watchdog import guard_collective


@dataclass(frozen=True)
class Move:
    layer: int
    expert: int                  # logical expert whose weights travel
    src: int                     # EP rank sending (holds the expert in the old placement)
    src_slot: int                # local slot there
    dst: int                     # EP rank receiving
    dst_slots: tuple[int, ...]   # local slots on dst that take the expert

    @property
    def remote(self) -> bool:
        return self.src != self.dst


def plan_moves(old: torch.Tensor, new: torch.Tensor, ep_size: int) -> list[Move]:
    """old, new: phy2log [L, P]. Moves ordered by (layer, dst, expert); only changed slots."""
    if old.shape != new.shape:
        raise ValueError(f"placements {list(old.shape)} and {list(new.shape)} must have the same shape")
    L, P = old.shape
    layout = ExpertLayout(P, ep_size)
    old_l, new_l = old.tolist(), new.tolist()
    moves = []
    for l in range(L):
        holders: dict[int, list[tuple[int, int]]] = {}   # expert -> [(rank, local slot)], first slot per rank
        for p, e in enumerate(old_l[l]):
            if not any(r == layout.rank_of(p) for r, _ in holders.get(e, ())):
                holders.setdefault(e, []).append((layout.rank_of(p), layout.local_of(p)))
        for dst in range(ep_size):
            wanted: dict[int, list[int]] = {}
            for s, p in enumerate(layout.slots(dst)):
                if new_l[l][p] != old_l[l][p]:
                    wanted.setdefault(new_l[l][p], []).append(s)
            for e in sorted(wanted):
                have = holders[e]
                src = next(((r, s) for r, s in have if r == dst), None) or have[(dst + l) % len(have)]
                moves.append(Move(l, e, src[0], src[1], dst, tuple(wanted[e])))
    return moves


def expert_bytes(params: list[torch.Tensor]) -> int:
    """B: bytes of one expert across stacked parameters [k, ...]."""
    return sum(p[0].numel() * p.element_size() for p in params)


def _pack(params: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    """[len(slots), B] uint8: the experts in `slots`, each parameter's bytes back to back."""
    idx = torch.tensor(slots, dtype=torch.long, device=params[0].device)
    return torch.cat([p.data[idx].reshape(len(slots), -1).view(torch.uint8) for p in params], dim=1)


def stage_layer(moves: list[Move], params: list[torch.Tensor], ep_rank: int, ctx,
                ranks: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch the weights this rank's changed slots of one layer will hold. Collective over the
    ranks that exchange weights in this layer (every rank calls it with the same moves).

    moves: this layer's moves (all ranks'); params: the layer's stacked expert parameters [k, ...].
    ranks: EP rank -> global rank (default: the same). Returns (slots [n] long, staged [n, B] uint8).
    """
    dev = params[0].device
    B = expert_bytes(params)
    mine = [m for m in moves if m.dst == ep_rank]
    slots = [s for m in mine for s in m.dst_slots]
    staged = torch.empty(len(slots), B, dtype=torch.uint8, device=dev)
    row, n = {}, 0                             # move -> first row of its slots in `staged`
    for m in mine:
        row[m], n = n, n + len(m.dst_slots)
    sends: dict[int, list[Move]] = {}
    recvs: dict[int, list[Move]] = {}
    for m in moves:
        if m.remote and m.src == ep_rank:
            sends.setdefault(m.dst, []).append(m)
        elif m.remote and m.dst == ep_rank:
            recvs.setdefault(m.src, []).append(m)
    glob = (lambda r: r) if ranks is None else ranks.__getitem__
    ops, inbox = [], {}
    for peer, ms in sorted(sends.items()):
        ops.append(dist.P2POp(dist.isend, _pack(params, [m.src_slot for m in ms]), glob(peer), ctx.ep_group))
    for peer, ms in sorted(recvs.items()):
        inbox[peer] = torch.empty(len(ms), B, dtype=torch.uint8, device=dev)
        ops.append(dist.P2POp(dist.irecv, inbox[peer], glob(peer), ctx.ep_group))
    if ops:
        with guard_collective(ctx):
            for w in dist.batch_isend_irecv(ops):
                w.wait()
    local = [m for m in mine if not m.remote]
    if local:
        packed = _pack(params, [m.src_slot for m in local])
        for i, m in enumerate(local):
            staged[row[m]:row[m] + len(m.dst_slots)] = packed[i]
    for peer, ms in recvs.items():
        for i, m in enumerate(ms):
            staged[row[m]:row[m] + len(m.dst_slots)] = inbox[peer][i]
    return torch.tensor(slots, dtype=torch.long, device=dev), staged


@torch.no_grad()
def swap_layer(params: list[torch.Tensor], slots: torch.Tensor, staged: torch.Tensor) -> None:
    """Write staged [n, B] bytes into slots [n] of the stacked parameters (in place)."""
    if not len(slots):
        return
    start = 0
    for p in params:
        nb = p[0].numel() * p.element_size()
        rows = staged[:, start:start + nb].contiguous().view(p.dtype).view(len(slots), *p.shape[1:])
        p.data[slots] = rows
        start += nb
