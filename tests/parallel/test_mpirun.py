"""`mpirun -n 2` (the mpich wheel's hydra, or Open MPI): bootstrap through mpi4py (one host: one
node), then a dispatch round trip equal to the one-process result."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.parallel.spawn import spawn
from tests.parallel.test_dispatch import H, P, fake_experts, make_inputs


def _mpi_rank() -> dict:
    from wideep.parallel import ParallelConfig, bootstrap, make_dispatcher, shutdown

    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2, timeout_s=30))
    assert ctx.launcher == "mpirun" and ctx.backend == "gloo" and ctx.watchdog is not None
    d = make_dispatcher(ctx, P, H, "torch")
    x, ids, w = make_inputs(5, [9, 4])[ctx.rank]
    got = d.dispatch(x, ids, w)
    out = d.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, ctx.rank * (P // 2)), got.handle)
    torch.testing.assert_close(out, fake_experts(x, ids, w, 0), atol=1e-5, rtol=1e-5)
    info = dict(rank=ctx.rank, world=ctx.world_size, local=(ctx.local_rank, ctx.local_world_size),
                node=(ctx.node_rank, ctx.num_nodes))
    shutdown(ctx)
    return info


@pytest.mark.multirank
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH (pip install mpich mpi4py)")
def test_mpirun_bootstrap_and_dispatch():
    pytest.importorskip("mpi4py")
    infos = spawn(_mpi_rank, 2, launcher="mpirun", timeout_s=90)
    assert infos == [dict(rank=r, world=2, local=(r, 2), node=(0, 1)) for r in range(2)]  # one host: one node
