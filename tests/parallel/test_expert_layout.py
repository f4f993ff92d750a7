"""ExpertLayout: the one place that says which EP rank holds a physical expert slot (contiguous
blocks), used by the dispatchers, the MoE shard, EPLB and the config checks."""
from __future__ import annotations

import pytest
import torch

from wideep.parallel import ExpertLayout


def test_docstring_example_and_tensors():
    lay = ExpertLayout(20, 4)
    assert (lay.per_rank, lay.rank_of(12), lay.local_of(12), lay.slots(3)) == (5, 2, 2, range(15, 20))
    ids = torch.tensor([[0, 19], [5, 14]])
    assert torch.equal(lay.rank_of(ids), torch.tensor([[0, 3], [1, 2]]))
    assert torch.equal(lay.local_of(ids), torch.tensor([[0, 4], [0, 4]]))
    assert [p for r in range(4) for p in lay.slots(r)] == list(range(20))


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"num_physical_experts \(9\) is not divisible by ep_size \(2\)"):
        ExpertLayout(9, 2)
    with pytest.raises(ValueError, match=r"experts \+ redundant \(16 \+ 3 = 19\) is not divisible by "
                                         r"disagg.prefill.ep_size \(4\); hint"):
        ExpertLayout.check(19, 4, what="experts + redundant", count="16 + 3 = 19", ep_name="disagg.prefill.ep_size",
                           hint="; hint")
    with pytest.raises(ValueError, match=r"ep_size must be an integer >= 1, got 0"):
        ExpertLayout(8, 0)


def test_the_moe_shard_and_the_dispatcher_use_it():
    from wideep.moe.layer import ExpertShard
    from wideep.parallel import ParallelContext, make_dispatcher
    shard = ExpertShard(20, ep_rank=3, ep_size=4)
    assert (shard.num_local, shard.first, shard.layout) == (5, 15, ExpertLayout(20, 4))
    with pytest.raises(ValueError, match=r"num_physical_experts \(18\) is not divisible by ep_size \(4\)"):
        ExpertShard(18, 0, 4)
    d = make_dispatcher(ParallelContext(world_size=4, ep_size=4), 20, 8, "torch")
    assert d.layout == ExpertLayout(20, 4) and d.experts_per_rank == 5
