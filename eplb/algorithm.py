"""Expert-parallel load balancer (EPLB): how many replicas each logical expert gets, and which
physical slot (hence GPU) each replica occupies, so that every GPU gets about the same load.

Shapes: L layers, E logical experts, P physical slots per layer (E + redundant), G GPUs,
N nodes, M most replicas of one expert. phy2log holds logical expert ids, log2phy physical
slot ids. Slots [g*P/G, (g+1)*P/G) live on GPU g; GPUs [n*G/N, (n+1)*G/N) on node n.

Policy (DeepSeek's EPLB, github.com/deepseek-ai/EPLB), hierarchical when num_groups % N == 0
so that group-limited routing stays inside a node:
  Step 1  pack expert groups onto nodes, balancing node load;
  Step 2  inside each node, give each redundant slot to the expert with the highest load per
          replica;
  Step 3  pack the node's replicas onto its GPUs, balancing GPU load, P/G slots each, never
          two replicas of one expert on one GPU when that is avoidable.
Otherwise the global policy: the same with one group on one node.

Migration-aware mode (current_phy2log given): Steps 1 and 3 start from today's placement,
move only what must move, then swap items off the hottest node/GPU until the layer is within
`max_balance_loss` balancedness of the from-scratch plan. Experts that stay on their GPU keep
their slot. A layer where that fails, or moves more slots, takes the from-scratch plan.

Example (the input of DeepSeek's README: 2 layers, 12 experts, 4 groups, 2 nodes, 8 GPUs):
    >>> w = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...                   [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    >>> phy2log, log2phy, logcnt = rebalance_experts(w, 16, 4, 2, 8)
    >>> phy2log                        # row = layer; slots 2g, 2g+1 are GPU g
    tensor([[ 5,  6,  5,  7,  8,  4,  3,  4, 10,  9, 10,  2,  0,  1, 11,  1],
            [ 7, 10,  6,  8,  6, 11,  8,  9,  2,  4,  5,  1,  5,  0,  3,  1]])
    >>> logcnt[0]                      # experts 1, 4, 5, 10 of layer 0 got a second replica
    tensor([1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1])
    >>> log2phy[0, 5]                  # expert 5's replicas sit in slots 0 and 2 (GPUs 0, 1)
    tensor([0, 2])
    >>> balancedness(w, phy2log, 8)    # mean / max GPU load per layer
    tensor([0.8277, 0.8050], dtype=torch.float64)
"""

import torch

from wideep.eplb._packing import improve_by_swaps, pack_items, replicate, stabilize_slots

__all__ = ["rebalance_experts", "balancedness", "moved_slots"]


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, *, current_phy2log: torch.Tensor | None = None,
                      max_balance_loss: float = 0.005):
    """Plan replication and placement for every layer.

    weight: [L, E] load per logical expert (float or int, any device).
    current_phy2log: [L, P] today's placement; given, the plan moves few slots at a cost of at
        most max_balance_loss balancedness per layer versus the from-scratch plan.
    Returns CPU int64 tensors phy2log: [L, P], log2phy: [L, E, M] padded with -1 (each
    expert's slots in replica order: its original first, then its replicas in the order they
    were added, as DeepSeek's planner lists them), logcnt: [L, E].
    When num_groups % num_nodes != 0 the global policy runs, and the expert groups play no part
    (E need not be a multiple of num_groups then).
    """
    w = _check(weight, num_replicas, num_groups, num_nodes, num_gpus, current_phy2log)
    if num_groups % num_nodes != 0:  # global policy
        num_groups = num_nodes = 1
    shape = (num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, phyrank = _place(w, *shape)
    if current_phy2log is not None:
        current = current_phy2log.detach().to("cpu", torch.int64).contiguous()
        phy2log, phyrank = _migrate(w, phy2log, phyrank, current, shape, max_balance_loss)
    log2phy, logcnt = _invert(phy2log, w.shape[1], phyrank)
    return phy2log, log2phy, logcnt


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Mean GPU load / max GPU load per layer: [L] float64, 1.0 is perfect.

    weight: [L, E]; phy2log: [L, P]. An expert's load is split evenly over its replicas.
    """
    gpu = _gpu_load(weight.detach().to("cpu", torch.float64), phy2log.cpu(), num_gpus)
    top = gpu.max(-1).values
    return torch.where(top > 0, gpu.mean(-1) / top, 1.0)


def moved_slots(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor) -> torch.Tensor:
    """Slots per layer whose logical expert changed (weights to load): [L] int64."""
    return (old_phy2log != new_phy2log).sum(-1)


def _check(weight, P, num_groups, N, G, current) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [layers, experts], got shape {tuple(weight.shape)}")
    L, E = weight.shape
    for name, v in (("num_replicas", P), ("num_groups", num_groups), ("num_nodes", N),
                    ("num_gpus", G)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if P % G:
        raise ValueError(f"num_replicas ({P}) must be a multiple of num_gpus ({G})")
    if G % N:
        raise ValueError(f"num_gpus ({G}) must be a multiple of num_nodes ({N})")
    if P < E:
        raise ValueError(f"num_replicas ({P}) must be >= the number of logical experts ({E})")
    if E % num_groups and num_groups % N == 0:  # the hierarchical policy packs whole groups
        raise ValueError(f"experts ({E}) must be a multiple of num_groups ({num_groups})")
    w = weight.detach().to("cpu", torch.float64).contiguous()
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight must be finite and non-negative")
    if current is not None:
        if tuple(current.shape) != (L, P):
            raise ValueError(f"current_phy2log must have shape [layers, num_replicas] = "
                             f"[{L}, {P}], got {list(current.shape)}")
        if current.numel() and (current.min() < 0 or current.max() >= E):
            raise ValueError(f"current_phy2log ids must lie in [0, {E}), got "
                             f"[{int(current.min())}, {int(current.max())}]")
    return w


def _place(w, P, num_groups, N, G, current=None, node_target=None, gpu_target=None):
    """-> phy2log: [L, P] for w: [L, E], and phyrank: [L, P], which replica of its expert each
    slot holds (0 = the original). With `current` ([L, P]) Steps 1 and 3 prefer today's
    node/GPU and then swap until the heaviest node/GPU is within node_target/gpu_target ([L])."""
    L, E = w.shape
    group_size, S, k = E // num_groups, P // N, P // G  # S: slots per node, k: slots per GPU
    epn, gpn = E // N, G // N                           # experts, GPUs per node

    # Step 1: pack expert groups onto nodes.
    group_w = w.view(L, num_groups, group_size).sum(-1)                  # [L, groups]
    group_ids = torch.arange(num_groups).expand(L, -1)
    home = None if current is None else _current_node_of_group(current, group_size, num_groups,
                                                                 N, S)
    group_node = pack_items(group_w, group_ids, num_groups, N, home)
    if node_target is not None and N > 1:
        group_node = improve_by_swaps(group_w, group_ids, num_groups, group_node, N, node_target)
    # Node-local expert index m: node n owns the groups packed on it, in group-id order.
    group_order = (group_node * num_groups + group_ids).argsort(-1)      # [L, groups]
    m2log = (group_order[..., None] * group_size + torch.arange(group_size)).view(L * N, epn)

    # Step 2: replicate the heaviest experts inside each node.
    w_node = w.gather(1, m2log.view(L, E)).view(L * N, epn)              # [L*N, epn]
    cnt = replicate(w_node, S)                                           # [L*N, epn]
    rep2m = torch.repeat_interleave(torch.arange(L * N * epn), cnt.flatten()).view(L * N, S) % epn
    rep_w = (w_node / cnt).gather(1, rep2m)                              # [L*N, S] per replica

    # Step 3: pack the node's replicas onto its GPUs (key = expert: no two on one GPU).
    home = None if current is None else _current_gpu_of_replica(w, current, m2log, rep2m, cnt,
                                                                 N, k)
    gpu = pack_items(rep_w, rep2m, epn, gpn, home)                       # [L*N, S] local GPU
    if gpu_target is not None:
        gpu = improve_by_swaps(rep_w, rep2m, epn, gpu, gpn, gpu_target.repeat_interleave(N))
    # Slots in GPU order, heaviest replica first inside a GPU.
    by_w = rep_w.argsort(dim=-1, descending=True, stable=True)
    slot2rep = by_w.gather(1, gpu.gather(1, by_w).argsort(dim=-1, stable=True))
    # An expert's replicas are contiguous in rep2m, original first: the offset in its run is its rank.
    rep_rank = torch.arange(S) - (cnt.cumsum(-1) - cnt).gather(1, rep2m)
    return (m2log.gather(1, rep2m.gather(1, slot2rep)).view(L, P),
            rep_rank.gather(1, slot2rep).view(L, P))


def _current_node_of_group(current, group_size, num_groups, N, S) -> torch.Tensor:
    """[L, groups]: the node holding most of each group's slots today."""
    L, P = current.shape
    slot_node = torch.arange(P) // S
    held = torch.zeros(L, num_groups * N).scatter_add_(
        1, current // group_size * N + slot_node, torch.ones(L, P))
    held = held.view(L, num_groups, N)
    return torch.where(held.sum(-1) > 0, held.argmax(-1), -1)


def _current_gpu_of_replica(w, current, m2log, rep2m, cnt, N, k) -> torch.Tensor:
    """[L*N, S]: for replica r of node-local expert m, the (node-local) GPU of the r-th copy of
    m on this node today, or -1. Copies on the lightest GPUs come first, so when an expert
    loses replicas it leaves its heaviest GPUs."""
    L, P = current.shape
    X, epn = cnt.shape
    E, S, M = w.shape[1], P // N, int(cnt.max())
    log2m = torch.full((X, E), epn, dtype=torch.int64)
    log2m.scatter_(1, m2log, torch.arange(epn).expand(X, -1))
    occ_m = log2m.gather(1, current.view(X, S))              # [X, S], epn: not on this node
    occ_gpu = (torch.arange(S) // k).expand(X, -1)
    cur_cnt = torch.zeros(L, E, dtype=w.dtype).scatter_add_(1, current,
                                                          torch.ones(L, P, dtype=w.dtype))
    occ_w = (w.gather(1, current) / cur_cnt.gather(1, current)).view(X, S)
    gpu_load = torch.zeros(X, S // k, dtype=w.dtype).scatter_add_(1, occ_gpu, occ_w)
    # Sort copies by (expert, GPU load, GPU); slots start in GPU order, so two stable sorts do.
    o = gpu_load.gather(1, occ_gpu).argsort(dim=-1, stable=True)
    o = o.gather(1, occ_m.gather(1, o).argsort(dim=-1, stable=True))
    m, g = occ_m.gather(1, o), occ_gpu.gather(1, o)
    dup = torch.zeros_like(m, dtype=torch.bool)
    dup[:, 1:] = (m[:, 1:] == m[:, :-1]) & (g[:, 1:] == g[:, :-1])
    valid = (m < epn) & ~dup
    before = valid.cumsum(-1) - valid.long()                # valid copies before each position
    first = torch.searchsorted(m, torch.arange(epn + 1).expand(X, -1).contiguous())
    rank = before - before.gather(1, first.clamp(max=S - 1)).gather(1, m.clamp(max=epn))
    ok = valid & (rank < M)
    table = torch.full((X, epn * M + 1), -1, dtype=torch.int64)  # last column: discarded
    table.scatter_(1, torch.where(ok, m * M + rank, epn * M), torch.where(ok, g, -1))
    table[:, -1] = -1
    rep_rank = torch.arange(S) - (cnt.cumsum(-1) - cnt).gather(1, rep2m)
    return table.gather(1, rep2m * M + rep_rank)


def _migrate(w, fresh, fresh_rank, current, shape, max_balance_loss):
    """Per layer, the sticky plan if it is within max_balance_loss of `fresh` and moves no more
    slots than it; otherwise `fresh` (with slots stabilised). -> phy2log [L, P], phyrank [L, P]."""
    P, num_groups, N, G = shape
    k = P // G
    fresh, fresh_rank = stabilize_slots(fresh, current, k, fresh_rank)
    gpu = _gpu_load(w, fresh, G)                                         # [L, G]
    node = gpu.view(len(gpu), N, -1).sum(-1)                             # [L, N]
    # Allowed max load = mean / (balancedness - loss); the node level gets half the loss.
    gpu_target = _max_for(gpu, max_balance_loss)
    node_target = _max_for(node, max_balance_loss / 2)
    sticky, sticky_rank = _place(w, P, num_groups, N, G, current, node_target, gpu_target)
    sticky, sticky_rank = stabilize_slots(sticky, current, k, sticky_rank)
    good = balancedness(w, sticky, G) >= balancedness(w, fresh, G) - max_balance_loss - 1e-12
    good &= moved_slots(current, sticky) <= moved_slots(current, fresh)
    return torch.where(good[:, None], sticky, fresh), torch.where(good[:, None], sticky_rank, fresh_rank)


def _max_for(load: torch.Tensor, loss: float) -> torch.Tensor:
    """[L]: the max load at which load ([L, K]) would lose `loss` balancedness (a hair under)."""
    mean, top = load.mean(-1), load.max(-1).values
    allowed = torch.where(top > 0, mean / top, 1.0) - loss
    return torch.where(allowed > 0, mean / allowed.clamp(min=1e-12), float("inf")) * (1 - 1e-9)


def _gpu_load(w, phy2log, G) -> torch.Tensor:
    """[L, G] load per GPU; w: [L, E] float64, phy2log: [L, P]."""
    L, P = phy2log.shape
    cnt = torch.zeros(L, w.shape[1], dtype=w.dtype).scatter_add_(
        1, phy2log, torch.ones(L, P, dtype=w.dtype))
    per_slot = w.gather(1, phy2log) / cnt.gather(1, phy2log)
    return per_slot.view(L, G, -1).sum(-1)


def _invert(phy2log, E, phyrank=None):
    """log2phy: [L, E, M] (-1 padded) and logcnt: [L, E] from phy2log [L, P]. Each expert's slots
    are listed by phyrank ([L, P], the replica each slot holds), or ascending without it."""
    L, P = phy2log.shape
    logcnt = torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    M = int(logcnt.max()) if L else 1  # SYNC: planner output size, CPU (L = 0: a model without MoE layers)
    if phyrank is None:
        slots = (phy2log * P + torch.arange(P)).argsort(-1)   # grouped by expert, slots ascending
        experts = phy2log.gather(1, slots)
        phyrank = torch.empty_like(phy2log).scatter_(
            1, slots, torch.arange(P) - (logcnt.cumsum(-1) - logcnt).gather(1, experts))
    log2phy = torch.full((L, E * M), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * M + phyrank, torch.arange(P).expand(L, -1))
    return log2phy.view(L, E, M), logcnt
