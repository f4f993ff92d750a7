"""EPLB runtime pieces on one process: placement state and files, the replica map, the load recorder,
the move plan, stage/swap on one rank, and the MoE layer's hooks."""
from __future__ import annotations

import json

import pytest
import torch

from wideep.eplb import ExpertMap, LoadRecorder, Placement
from wideep.eplb.transfer import expert_bytes, plan_moves, stage_layer, swap_layer


def test_initial_placement_replicates_round_robin():
    p = Placement.initial(2, 4, 6)
    assert p.phy2log.tolist() == [[0, 1, 2, 3, 0, 1]] * 2
    assert p.logcnt.tolist() == [[2, 2, 1, 1]] * 2
    assert p.log2phy[0].tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]
    assert p.local(0, 1, 2) == [3, 0, 1]
    assert not p.is_identity(0) and Placement.initial(1, 4, 4).is_identity(0)


def test_placement_validation_and_files(tmp_path):
    with pytest.raises(ValueError, match=r"leaves 1 logical experts without a slot \(first: layer 0, expert 3\)"):
        Placement.from_phy2log([[0, 1, 2, 2]], 4)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\), got \[0, 7\]"):
        Placement.from_phy2log([[0, 1, 2, 7]], 4)
    p = Placement.from_phy2log([[3, 2, 1, 0, 3, 3]], 4)
    path = str(tmp_path / "placement.json")
    p.save(path, note="extra keys are fine")
    assert torch.equal(Placement.load(path, 1, 4, 6).phy2log, p.phy2log)
    with pytest.raises(ValueError, match=r"phy2log is \[1, 6\], the model needs .* = \[2, 6\]"):
        Placement.load(path, 2, 4, 6)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Placement.load(str(tmp_path / "nope.json"), 1, 4, 6)
    (tmp_path / "bad.json").write_text(json.dumps({"load": [[1]]}))
    with pytest.raises(ValueError, match='has no "phy2log" key'):
        Placement.load(str(tmp_path / "bad.json"), 1, 4, 6)


def test_expert_map_spreads_tokens_evenly_and_deterministically():
    p = Placement.from_phy2log([[0, 1, 2, 3, 0, 0, 1, 2]], 4)     # expert 0 x3, 1 x2, 2 x2, 3 x1
    emap = ExpertMap(p.log2phy[0], p.logcnt[0], offset=1, device="cpu")
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]])           # [T=6, k=2] logical
    phys = emap(ids)
    assert torch.equal(p.phy2log[0][phys], ids)                                   # replicas of the right expert
    assert torch.equal(phys, emap(ids))                                           # no randomness
    assert torch.bincount(phys[:, 0], minlength=8)[[0, 4, 5]].tolist() == [2, 2, 2]
    shuffled = Placement.from_phy2log([[2, 0, 1]], 3)                              # a permutation, M = 1
    perm = ExpertMap(shuffled.log2phy[0], shuffled.logcnt[0], 0, "cpu")
    assert perm(torch.tensor([[0, 1, 2]])).tolist() == [[1, 2, 0]]


def test_recorder_window_slides_and_skips_dummy_steps():
    rec = LoadRecorder(num_layers=1, num_physical=4, num_experts=3, window_size=2, ep_size=2)
    phy2log = torch.tensor([[0, 1, 2, 0]])                                        # expert 0 in slots 0 and 3
    for step, slots in enumerate([[0, 0], [3, 1], [2, 2, 2]]):
        rec.layer_counts(0).index_add_(0, torch.tensor(slots), torch.ones(len(slots), dtype=torch.long))
        rec.end_step(num_tokens=1, phy2log=phy2log)
        rec.end_step(num_tokens=0, phy2log=phy2log)                               # dummy: not a step
    assert rec.recorded_steps == 3
    assert rec.window_load().tolist() == [[1, 1, 3]]                              # last 2 steps only
    assert rec.rank_load.tolist() == [[3, 4]]                                     # slots 0,1 | 2,3 since reset
    rec.layer_counts(0)[1] += 5
    rec.end_step(num_tokens=0, phy2log=phy2log)                                   # a dummy step's counts drop
    assert rec.window_load().tolist() == [[1, 1, 3]] and rec.counts.sum() == 0
    rec.layer_counts(0)[1] += 5
    rec.flush(phy2log)
    assert rec.window_load().tolist() == [[0, 5, 3]]


def test_plan_moves_only_changed_slots_local_copies_first():
    old = torch.tensor([[0, 1, 2, 3, 0, 1]])                                      # ranks: [0,1,2] [3,0,1]
    new = torch.tensor([[0, 1, 3, 3, 2, 1]])
    moves = plan_moves(old, new, 2)
    assert [(m.expert, m.src, m.src_slot, m.dst, m.dst_slots) for m in moves] == [
        (3, 1, 0, 0, (2,)),            # rank 0 slot 2 takes expert 3 from rank 1 (its only holder)
        (2, 0, 2, 1, (1,))]            # rank 1 slot 1 takes expert 2 from rank 0
    # expert 0 leaves rank 1 slot 1, which rank 1 refills with its own expert 1 copy: local
    local = plan_moves(torch.tensor([[0, 1, 2, 3, 0, 1]]), torch.tensor([[0, 1, 2, 3, 1, 0]]), 2)
    assert [(m.expert, m.remote) for m in local] == [(0, False), (1, False)]
    assert plan_moves(old, old, 2) == []


def test_stage_and_swap_on_one_rank_rewrites_only_changed_slots():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 6, 3, generator=g), torch.randn(4, 3, 2, generator=g).to(torch.float64)
    params = [w13.clone(), w2.clone()]
    assert expert_bytes(params) == 6 * 3 * 4 + 3 * 2 * 8
    old, new = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[3, 1, 0, 0]])        # duplicates allowed on 1 rank
    slots, staged = stage_layer(plan_moves(old, new, 1), params, 0, ctx=None)
    assert torch.equal(params[0], w13)                                            # staging touches nothing live
    swap_layer(params, slots, staged)
    for slot, e in enumerate(new[0].tolist()):
        assert torch.equal(params[0][slot], w13[e]) and torch.equal(params[1][slot], w2[e])


def test_moe_layer_maps_and_counts_physical_ids():
    from wideep.moe.config import MoEConfig
    from wideep.moe.layer import ExpertShard, MoELayer
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=4, n_routed_experts=4, top_k=2,
                    n_shared_experts=0, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
                    norm_topk_prob=True, routed_scaling_factor=1.0)
    from wideep.parallel.expert_routing import ExpertRouting
    routing = ExpertRouting(1, list(range(6)))
    layer = MoELayer(cfg, ExpertShard(6), routing=routing.layers[0])
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data.normal_()
    x = torch.randn(5, 8)
    want = layer(x)                                          # slots 0-3 = experts 0-3, identity
    w13, w2 = layer.experts.w13.data[:4].clone(), layer.experts.w2.data[:4].clone()
    p = Placement.from_phy2log([[2, 0, 1, 3, 2, 0]], 4)
    for slot, e in enumerate(p.phy2log[0].tolist()):        # the slots' weights follow the placement
        layer.experts.w13.data[slot], layer.experts.w2.data[slot] = w13[e], w2[e]
    p.install(routing, 0, 1, "cpu")
    routing.record_into([torch.zeros(6, dtype=torch.long)])
    assert torch.allclose(layer(x), want, atol=1e-6)
    assert layer.load_counts.sum() == 5 * 2 and layer.local_phy2log == [2, 0, 1, 3, 2, 0]
    assert layer.load_counts[[4, 5]].sum() > 0                                   # replicas got tokens
