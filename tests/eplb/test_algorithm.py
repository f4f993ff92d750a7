"""eplb.algorithm: DeepSeek's README example, structural invariants, plain-Python references
for the vectorised helpers, migration-aware planning, validation, planning time."""
from __future__ import annotations

import doctest
import time

import pytest
import torch

import wideep.eplb.algorithm as eplb_algorithm
from wideep.eplb import balancedness, moved_slots, rebalance_experts
from wideep.eplb._packing import fix_duplicates, pack_items, replicate

# Input and published output of github.com/deepseek-ai/EPLB's README (data, not code).
README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])

# (E experts, P slots, groups, nodes, gpus); the last two use the global policy.
CONFIGS = [(12, 16, 4, 2, 8), (64, 80, 8, 4, 16), (64, 96, 8, 2, 8), (12, 16, 3, 2, 4),
           (32, 64, 4, 8, 16)]


def _skewed(L, E, seed, sigma=1.0):
    """Lognormal expert loads: a few hot experts, a long cold tail (like real routing)."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(L, E, generator=g) * sigma) * 1000


def _zipf(L, E, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(E, generator=g) for _ in range(L)]) + 1
    return 1e5 / ranks.double()


def _drift(w, seed, amount=0.2):
    g = torch.Generator().manual_seed(seed)
    return w * (1 + amount * (2 * torch.rand(w.shape, generator=g, dtype=w.dtype) - 1))


def _check_plan(weight, P, num_groups, num_nodes, num_gpus, plan):
    phy2log, log2phy, logcnt = plan
    L, E = weight.shape
    assert phy2log.shape == (L, P) and phy2log.dtype == torch.int64
    assert logcnt.shape == (L, E) and (logcnt >= 1).all() and (logcnt.sum(-1) == P).all()
    assert log2phy.shape == (L, E, int(logcnt.max()))
    for l in range(L):
        assert torch.equal(torch.bincount(phy2log[l], minlength=E), logcnt[l])
        for e in range(E):
            c = int(logcnt[l, e])
            assert (phy2log[l, log2phy[l, e, :c]] == e).all()
            assert (log2phy[l, e, c:] == -1).all()
            assert log2phy[l, e, :c].unique().numel() == c   # each slot once, in replica order
    # No GPU holds two replicas of one expert (avoidable here: every count <= GPUs per domain).
    k = P // num_gpus
    domain_gpus = num_gpus // num_nodes if num_groups % num_nodes == 0 else num_gpus
    if logcnt.max() <= domain_gpus:
        per_gpu = phy2log.view(L, num_gpus, k).sort(-1).values
        assert (per_gpu.diff(dim=-1) != 0).all()
    if num_groups % num_nodes == 0:  # hierarchical: every group lives on one node
        node = (torch.arange(P) // (P // num_nodes)).expand(L, -1)
        group = phy2log // (E // num_groups)
        for l in range(L):
            for gr in range(num_groups):
                assert node[l][group[l] == gr].unique().numel() == 1


def test_readme_example_at_least_as_balanced_as_deepseek():
    phy2log, _, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    ours = balancedness(README_WEIGHT, phy2log, 8)
    theirs = balancedness(README_WEIGHT, README_PHY2LOG, 8)
    assert (ours >= theirs - 1e-12).all(), (ours, theirs)
    _check_plan(README_WEIGHT, 16, 4, 2, 8, rebalance_experts(README_WEIGHT, 16, 4, 2, 8))


# DeepSeek's planner on README_WEIGHT (run once, its output recorded): each expert's slots in
# replica order (the original, then replicas in the order they were added), not ascending.
README_LOG2PHY = [[[12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2], [1, -1], [3, -1], [4, -1], [9, -1],
                   [8, 10], [14, -1]],
                  [[13, -1], [15, 11], [8, -1], [14, -1], [9, -1], [10, 12], [2, 4], [0, -1], [6, 3], [7, -1],
                   [1, -1], [5, -1]]]


def test_readme_example_log2phy_in_replica_order_as_deepseek():
    phy2log, log2phy, _ = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert torch.equal(phy2log, README_PHY2LOG)
    assert log2phy.tolist() == README_LOG2PHY


def test_replica_order_survives_migration_aware_planning():
    """Rank r of an expert is the r-th replica the plan made; slots moved to keep experts in place
    carry their rank along, so every expert still lists each of its slots exactly once."""
    w = _skewed(4, 32, seed=3)
    phy2log, _, _ = rebalance_experts(w, 48, 4, 2, 8)
    plan = rebalance_experts(_drift(w, seed=4), 48, 4, 2, 8, current_phy2log=phy2log)
    _check_plan(_drift(w, seed=4), 48, 4, 2, 8, plan)


def test_groups_that_do_not_divide_the_experts_take_the_global_policy():
    """DeepSeek's and vLLM's contract: num_groups % num_nodes != 0 selects the global policy, where
    the group size plays no part, so 4 experts in 3 "groups" is a valid input."""
    w = torch.tensor([[10, 20, 30, 40]])
    plan = rebalance_experts(w, 8, 3, 2, 4)
    _check_plan(w, 8, 3, 2, 4, plan)
    phy2log, _, logcnt = plan
    assert logcnt.tolist() == [[1, 2, 2, 3]]
    assert torch.equal(phy2log, rebalance_experts(w, 8, 1, 1, 4)[0])  # exactly the global policy


def test_docstring_example():
    result = doctest.testmod(eplb_algorithm)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("E,P,num_groups,num_nodes,num_gpus", CONFIGS)
@pytest.mark.parametrize("kind", ["skewed", "int", "zero", "one_hot"])
def test_invariants(E, P, num_groups, num_nodes, num_gpus, kind):
    L = 3
    w = {"skewed": _skewed(L, E, seed=E + P),
         "int": torch.randint(0, 50, (L, E), generator=torch.Generator().manual_seed(1)),
         "zero": torch.zeros(L, E),
         "one_hot": torch.eye(E)[:L] * 100}[kind]
    _check_plan(w, P, num_groups, num_nodes, num_gpus,
                rebalance_experts(w, P, num_groups, num_nodes, num_gpus))


def test_hot_expert_replicas_spread_over_gpus():
    # Two hot experts get 9 replicas each on 16 GPUs: never two of one expert on one GPU.
    w = torch.ones(2, 64)
    w[:, [7, 9]] = 1000
    phy2log, _, logcnt = rebalance_experts(w, 80, 1, 1, 16)
    assert (logcnt[:, [7, 9]] == 9).all()
    for e in (7, 9):
        gpus = (phy2log == e).nonzero()[:, 1].view(2, 9) // 5
        assert all(row.unique().numel() == 9 for row in gpus)
    # One hot expert gets all 17: more than 16 GPUs, so exactly one GPU holds two.
    w[:, 9] = 1
    phy2log, _, logcnt = rebalance_experts(w, 80, 1, 1, 16)
    assert (logcnt[:, 7] == 17).all()
    per_gpu = (phy2log == 7).view(2, 16, 5).sum(-1)
    assert (per_gpu >= 1).all() and (per_gpu.max(-1).values == 2).all()


def test_balancedness_and_moved_slots_by_hand():
    w = torch.tensor([[6.0, 2.0, 2.0]])
    # GPU 0 = slots {0, 1}: expert 0 twice -> 6; GPU 1 = experts 1, 2 -> 4. mean 5 / max 6.
    assert balancedness(w, torch.tensor([[0, 0, 1, 2]]), 2).item() == pytest.approx(5 / 6)
    assert balancedness(w, torch.tensor([[0, 1, 0, 2]]), 2).item() == pytest.approx(1.0)
    assert balancedness(torch.zeros(1, 3), torch.tensor([[0, 1, 0, 2]]), 2).item() == 1.0
    assert moved_slots(torch.tensor([[0, 1, 0, 2]]), torch.tensor([[0, 0, 1, 2]])).tolist() == [2]


def _reference_replicate(weight, num_phy):
    cnt = [1] * len(weight)
    for _ in range(num_phy - len(weight)):
        cnt[max(range(len(weight)), key=lambda i: (weight[i] / cnt[i], -cnt[i], -i))] += 1
    return cnt


def _reference_pack(weight, keys, num_packs):
    """Greedy, one row, plain Python: heaviest item first to the lightest pack with room."""
    cap = len(weight) // num_packs
    load, items, held = [0.0] * num_packs, [0] * num_packs, [set() for _ in range(num_packs)]
    pack = [-1] * len(weight)
    for i in sorted(range(len(weight)), key=lambda i: -weight[i]):  # stable, like the torch sort
        room = [p for p in range(num_packs) if items[p] < cap]
        free = [p for p in room if keys[i] not in held[p]] or room
        p = min(free, key=lambda p: (load[p], p))
        pack[i], load[p], items[p] = p, load[p] + weight[i], items[p] + 1
        held[p].add(keys[i])
    return pack


def test_replicate_and_pack_match_plain_python_reference():
    w = _skewed(16, 24, seed=3)
    w[0] = 0.0                      # ties everywhere
    w[1, :12] = w[1, 12:]           # pairwise ties
    cnt = replicate(w.double(), 40)
    for x in range(len(w)):
        assert cnt[x].tolist() == _reference_replicate(w[x].double().tolist(), 40)
    rep2e = torch.repeat_interleave(torch.arange(16 * 24), cnt.flatten()).view(16, 40) % 24
    rep_w = (w.double() / cnt).gather(1, rep2e)
    pack = pack_items(rep_w, rep2e, 24, 8)
    for x in range(len(w)):
        assert pack[x].tolist() == _reference_pack(rep_w[x].tolist(), rep2e[x].tolist(), 8)


def test_fix_duplicates_repairs_a_clash():
    # Packs of 2: pack 0 holds key 5 twice. One swap with pack 1 or 2 repairs it.
    weight = torch.tensor([[4.0, 4.0, 3.0, 1.0, 2.0, 2.0]])
    keys = torch.tensor([[5, 5, 1, 2, 3, 4]])
    pack = torch.tensor([[0, 0, 1, 1, 2, 2]])
    fixed = fix_duplicates(weight, keys, pack, 3)
    assert torch.bincount(fixed[0], minlength=3).tolist() == [2, 2, 2]
    for p in range(3):
        assert keys[0][fixed[0] == p].unique().numel() == 2
    assert (fixed != pack).sum() == 2  # one swap: the 4.0 traded for the 3.0 (closest weight)
    assert fixed[0, 2] == 0


def test_fix_duplicates_clears_every_avoidable_clash():
    # Random rows where every key has <= K items, packed in key-clustered order (worst case).
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        K, cap = (int(v) for v in torch.randint(2, 7, (2,), generator=g))
        n = K * cap
        cnt = torch.ones(int(torch.randint(cap, n + 1, (1,), generator=g)), dtype=torch.int64)
        while cnt.sum() < n:
            e = int(torch.randint(0, len(cnt), (1,), generator=g))
            cnt[e] += int(cnt[e] < K)
        keys = torch.repeat_interleave(torch.arange(len(cnt)), cnt)[None]
        weight = torch.rand(1, n, generator=g, dtype=torch.float64)
        fixed = fix_duplicates(weight, keys, (torch.arange(n) // cap)[None], K)
        assert torch.bincount(fixed[0], minlength=K).tolist() == [cap] * K
        assert torch.unique(fixed * n + keys).numel() == n  # no (pack, key) pair twice


@pytest.mark.parametrize("num_groups,num_nodes", [(8, 4), (4, 8)])
def test_migration_without_drift_moves_nothing(num_groups, num_nodes):
    w = _skewed(4, 256, seed=7)
    current, _, _ = rebalance_experts(w, 288, num_groups, num_nodes, 32)
    again, _, _ = rebalance_experts(w, 288, num_groups, num_nodes, 32, current_phy2log=current)
    assert moved_slots(current, again).sum() == 0


@pytest.mark.parametrize("num_groups,num_nodes,loads", [(4, 8, "lognormal"), (4, 8, "zipf"),
                                                        (8, 4, "lognormal")])
def test_migration_keeps_balance_and_moves_few_slots(num_groups, num_nodes, loads):
    L, E, P, G = 8, 256, 288, 32
    gaps, sticky_moved, fresh_moved = [], 0, 0
    for seed in range(3):
        w0 = _skewed(L, E, seed) if loads == "lognormal" else _zipf(L, E, seed)
        current, _, _ = rebalance_experts(w0, P, num_groups, num_nodes, G)
        w1 = _drift(w0, seed=100 + seed)
        fresh, _, _ = rebalance_experts(w1, P, num_groups, num_nodes, G)
        plan = rebalance_experts(w1, P, num_groups, num_nodes, G, current_phy2log=current)
        _check_plan(w1, P, num_groups, num_nodes, G, plan)
        sticky = plan[0]
        gaps.append(balancedness(w1, fresh, G) - balancedness(w1, sticky, G))
        sticky_moved += moved_slots(current, sticky).sum().item()
        fresh_moved += moved_slots(current, fresh).sum().item()
        # An expert that stays on its GPU keeps its slot.
        k = P // G
        for l in range(L):
            for s in range(P):
                gpu_now = sticky[l, s // k * k:(s // k + 1) * k]
                assert current[l, s] not in gpu_now or sticky[l, s] == current[l, s]
    total = 3 * L * P
    gap = torch.cat(gaps).max().item()
    print(f"\n{loads} groups={num_groups} nodes={num_nodes}: balancedness gap {gap:.4f}, "
          f"moved {sticky_moved / total:.1%} (from scratch {fresh_moved / total:.1%})")
    assert gap <= 0.01
    assert sticky_moved <= 0.25 * total
    assert fresh_moved >= 0.6 * total  # the drift is real: a fresh plan reshuffles most slots


@pytest.mark.parametrize("num_groups,num_nodes", [(8, 4), (4, 8)])
def test_large_plan_is_fast(num_groups, num_nodes):
    # 61 MoE layers, 256 experts, 288 slots on 32 GPUs; both policies, fresh and migration.
    w = _skewed(61, 256, seed=0)
    start = time.perf_counter()
    phy2log, _, logcnt = rebalance_experts(w, 288, num_groups, num_nodes, 32)
    fresh_s = time.perf_counter() - start
    start = time.perf_counter()
    rebalance_experts(_drift(w, seed=1), 288, num_groups, num_nodes, 32, current_phy2log=phy2log)
    migrate_s = time.perf_counter() - start
    print(f"\ngroups={num_groups} nodes={num_nodes}: plan {fresh_s:.2f} s, "
          f"migration-aware plan {migrate_s:.2f} s")
    assert (logcnt.sum(-1) == 288).all()
    assert fresh_s < 60 and migrate_s < 60


@pytest.mark.parametrize("args,current,message", [
    (((2, 12, 12), 16, 4, 2, 8), None, r"2-D .*\(2, 12, 12\)"),
    (((2, 12), 18, 4, 2, 8), None, r"num_replicas \(18\) must be a multiple of num_gpus \(8\)"),
    (((2, 12), 16, 4, 3, 8), None, r"num_gpus \(8\) must be a multiple of num_nodes \(3\)"),
    (((2, 12), 8, 4, 2, 8), None, r"num_replicas \(8\) must be >= .* \(12\)"),
    (((2, 12), 16, 5, 1, 8), None, r"experts \(12\) must be a multiple of num_groups \(5\)"),
    (((2, 12), 16, 4, 2, 0), None, r"num_gpus must be positive, got 0"),
    (((2, 12), 16, 4, 2, 8), torch.zeros(2, 12, dtype=torch.int64), r"\[2, 16\], got \[2, 12\]"),
    (((2, 12), 16, 4, 2, 8), torch.full((2, 16), 12), r"\[0, 12\), got \[12, 12\]"),
])
def test_validation_errors_show_the_numbers(args, current, message):
    shape, *rest = args
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(shape), *rest, current_phy2log=current)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-torch.ones(2, 12), 16, 4, 2, 8)
