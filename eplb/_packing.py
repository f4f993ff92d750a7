"""Replication and packing helpers for `eplb.algorithm`, vectorised over rows.

A row is one independent problem: a layer, or a (layer, node) pair in the hierarchical policy.
Legend: X rows, n items per row, K packs per row (each pack holds exactly n/K items),
U keys (an item's key is its logical expert; two items with one key should not share a pack).
Every function loops over items or swaps in Python and over rows in torch, so planning 61 layers
costs about as much as planning one.
"""

import torch

_INF = float("inf")


def replicate(weight: torch.Tensor, num_phy: int) -> torch.Tensor:
    """Replica counts that minimise the heaviest load per replica.

    weight: [X, n] load per item; returns cnt: [X, n] int64, cnt >= 1, cnt.sum(-1) == num_phy.
    Each extra replica goes to the item with the highest load per replica; ties go to the item
    with fewer replicas, so all-zero rows spread replicas instead of piling them on item 0.
    """
    X, n = weight.shape
    rows = torch.arange(X)
    cnt = torch.ones(X, n, dtype=torch.int64)
    for _ in range(num_phy - n):
        per_rep = weight / cnt
        top = per_rep == per_rep.max(-1, keepdim=True).values
        pick = torch.where(top, cnt, torch.iinfo(torch.int64).max).argmin(-1)
        cnt[rows, pick] += 1
    return cnt


def _state(weight, keys, num_keys, pack, num_packs):
    """Load, item count and key count per pack of a partial assignment (pack == -1: unplaced)."""
    X = weight.shape[0]
    placed = pack >= 0
    p = pack.clamp(min=0)
    load = torch.zeros(X, num_packs, dtype=weight.dtype).scatter_add_(1, p, weight * placed)
    count = torch.zeros(X, num_packs, dtype=torch.int64).scatter_add_(1, p, placed.long())
    owned = torch.zeros(X, num_packs * num_keys, dtype=torch.int32)
    owned.scatter_add_(1, p * num_keys + keys, placed.int())
    return load, count, owned.view(X, num_packs, num_keys)


def pack_items(weight: torch.Tensor, keys: torch.Tensor, num_keys: int, num_packs: int,
               home: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy balanced packing, optionally sticky.

    weight: [X, n], keys: [X, n] in [0, num_keys), home: [X, n] preferred pack or -1.
    Returns pack: [X, n] in [0, num_packs), exactly n/num_packs items per pack.
    Items first stay at home (heaviest first while the pack has room); the rest go heaviest
    first to the lightest pack that has room and does not hold the item's key yet.
    """
    X, n = weight.shape
    cap = n // num_packs
    rows = torch.arange(X)
    order = weight.argsort(dim=-1, descending=True, stable=True)  # [X, n] heaviest first
    pack = torch.full((X, n), -1, dtype=torch.int64)
    if home is not None:
        h = home.gather(1, order)
        valid = h >= 0
        onehot = torch.nn.functional.one_hot(h.clamp(min=0), num_packs) * valid[..., None]
        seen = onehot.cumsum(1).gather(2, h.clamp(min=0)[..., None]).squeeze(-1)
        pack.scatter_(1, order, torch.where(valid & (seen <= cap), h, -1))
    load, count, owned = _state(weight, keys, num_keys, pack, num_packs)
    # [X, keys, packs]: one key's row of packs is a contiguous lookup (owned[r, :, key] with the
    # slice between two index tensors cost ~12 ms per item at 58 layers)
    owned = owned.transpose(1, 2).contiguous()
    for t in range(n):
        item = order[:, t]
        todo = pack[rows, item] < 0
        if not todo.any():
            continue
        r, item = rows[todo], item[todo]
        key, w = keys[r, item], weight[r, item]
        room = count[r] < cap
        ok = room & (owned[r, key] == 0)
        ok = torch.where(ok.any(-1, keepdim=True), ok, room)  # clash unavoidable: allow it
        choice = torch.where(ok, load[r], _INF).argmin(-1)
        pack[r, item] = choice
        load[r, choice] += w
        count[r, choice] += 1
        owned[r, key, choice] += 1
    return fix_duplicates(weight, keys, pack, num_packs)


def improve_by_swaps(weight: torch.Tensor, keys: torch.Tensor, num_keys: int, pack: torch.Tensor,
                     num_packs: int, target_max: torch.Tensor) -> torch.Tensor:
    """Swap items off the heaviest pack until its load is <= target_max (or no swap helps).

    weight, keys, pack: [X, n]; target_max: [X]. Returns a new pack: [X, n]. Each round, every
    row still above its target swaps one item of its heaviest pack with one item elsewhere,
    choosing the swap that leaves the smaller of the two packs' new maxima; a swap never
    creates a key clash. Each swap moves two items, so few rounds means few moved items.
    """
    X, n = weight.shape
    cap = n // num_packs
    rows = torch.arange(X)
    pack = pack.clone()
    load, _, owned = _state(weight, keys, num_keys, pack, num_packs)
    owned = owned.view(X, -1)
    active = torch.ones(X, dtype=torch.bool)
    for _ in range(2 * n):  # sum of squared loads falls with every swap: this never binds
        hot_load, hot = load.max(-1)
        active &= hot_load > target_max
        if not active.any():
            break
        a = (pack != hot[:, None]).to(torch.uint8).argsort(dim=-1, stable=True)[:, :cap]  # [X, cap]
        wa, ka = weight.gather(1, a), keys.gather(1, a)
        delta = wa[:, :, None] - weight[:, None, :]                          # [X, cap, n]
        new_hot = hot_load[:, None, None] - delta
        new_other = load.gather(1, pack)[:, None, :] + delta
        b_clash = owned.gather(1, hot[:, None] * num_keys + keys) > 0         # [X, n]
        a_clash = owned.gather(1, (pack[:, None, :] * num_keys + ka[..., None]).view(X, -1))
        ok = (delta > 0) & (new_other < hot_load[:, None, None])
        ok &= ~b_clash[:, None, :] & (a_clash.view(X, cap, n) == 0)
        score = torch.where(ok, torch.maximum(new_hot, new_other), _INF).view(X, -1)
        best, flat = score.min(-1)
        active &= best < _INF
        if not active.any():
            break
        r = rows[active]
        ai, bi = a[r, flat[r] // n], flat[r] % n
        p, q = hot[r], pack[r, bi]
        d = weight[r, ai] - weight[r, bi]
        load[r, p] -= d
        load[r, q] += d
        ka, kb = keys[r, ai], keys[r, bi]
        owned[r, p * num_keys + ka] -= 1
        owned[r, q * num_keys + kb] -= 1
        owned[r, p * num_keys + kb] += 1
        owned[r, q * num_keys + ka] += 1
        pack[r, ai], pack[r, bi] = q, p
    return pack


def fix_duplicates(weight: torch.Tensor, keys: torch.Tensor, pack: torch.Tensor,
                   num_packs: int) -> torch.Tensor:
    """Swap away key clashes (two items with one key in one pack) where possible.

    weight, keys, pack: [X, n]. The greedy packer almost never clashes (replicated experts are
    heavy, so they are placed while many packs have room); this repairs the rare row in Python,
    swapping a clashing item with the item of closest weight that clashes nowhere after the swap.
    """
    num_keys = int(keys.max()) + 1
    _, _, owned = _state(weight, keys, num_keys, pack, num_packs)
    bad_rows = (owned > 1).flatten(1).any(-1).nonzero().flatten().tolist()  # SYNC: planner, CPU
    if not bad_rows:
        return pack
    pack = pack.clone()
    for x in bad_rows:
        w, k, p = weight[x].tolist(), keys[x].tolist(), pack[x].tolist()
        held = [dict() for _ in range(num_packs)]  # pack -> {key: count}
        for i in range(len(p)):
            held[p[i]][k[i]] = held[p[i]].get(k[i], 0) + 1
        changed = True
        while changed:  # one pass almost always does; a swap may unblock another clash
            changed = False
            for a in range(len(p)):
                pa, ka = p[a], k[a]
                if held[pa][ka] < 2:
                    continue
                cands = [b for b in range(len(p))
                         if ka not in held[p[b]] and k[b] not in held[pa]]
                if not cands:
                    continue
                b = min(cands, key=lambda b: abs(w[a] - w[b]))
                pb, kb = p[b], k[b]
                for pk, kk, dv in ((pa, ka, -1), (pb, kb, -1), (pa, kb, 1), (pb, ka, 1)):
                    held[pk][kk] = held[pk].get(kk, 0) + dv
                    if held[pk][kk] == 0:
                        del held[pk][kk]
                p[a], p[b] = pb, pa
                changed = True
        pack[x] = torch.tensor(p)
    return pack


def stabilize_slots(new: torch.Tensor, old: torch.Tensor, slots_per_gpu: int,
                    rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder the slots inside each GPU so that an expert that stays on a GPU keeps its slot.

    new, old: [L, P] phy2log (logical ids); rank: [L, P] the replica each slot of `new` holds,
    moved along with it. Only the order inside each GPU's slot range changes. -> (new, rank).
    """
    L, P = new.shape
    nv = new.view(L, -1, slots_per_gpu)
    ov = old.view(L, -1, slots_per_gpu)
    eq = nv[..., :, None] == ov[..., None, :]          # [L, G, new j, old i]
    eq &= eq.cumsum(-1) == 1                           # each new item: its first old position
    eq &= eq.cumsum(-2) == 1                           # each old position: one new item
    matched = eq.any(-1)
    taken = eq.any(-2)
    free = taken.to(torch.uint8).argsort(dim=-1, stable=True)         # free positions first
    nth_unmatched = ((~matched).cumsum(-1) - 1).clamp(min=0)
    pos = torch.where(matched, eq.to(torch.uint8).argmax(-1), free.gather(-1, nth_unmatched))
    moved = torch.empty_like(nv).scatter_(-1, pos, nv).view(L, P)
    return moved, torch.empty_like(nv).scatter_(-1, pos, rank.view_as(nv)).view(L, P)
