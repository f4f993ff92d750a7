"""Around the MoE half's one C call (the fused decode's: engine/model/fused_decode.py; the call against the
layer's operations: tests/engine/test_fused_weights.py): the dispatcher's routing histogram counts the rows a
fused half ran as local to one node, and the routed experts hand bigger bfloat16 batches to BLAS where it is
faster (cpu/linear.py experts_max_rows)."""
from __future__ import annotations

import pytest
import torch

from wideep.cpu.build import unusable
from wideep.parallel.context import ParallelContext
from wideep.parallel.dispatch import LocalDispatcher

pytestmark = pytest.mark.skipif(unusable() is not None, reason=f"CPU kernels not built: {unusable()}")


def test_add_local_is_for_one_node():
    d = LocalDispatcher(ParallelContext.single("cpu"), 8, 48)
    d.routing.add_local(3)
    assert d.routing.tolist() == [0, 3]
    d.routing.nodes = type(d.routing.nodes)(4, 2, 0)   # a two-node EP group
    with pytest.raises(ValueError, match="one-node EP group, this one spans 2 nodes"):
        d.routing.add_local(1)


@pytest.mark.parametrize("dtype,tiles", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)],
                         ids=["bf16", "bf16-tiles", "f32"])
def test_experts_hand_bigger_bf16_batches_to_blas_sooner(dtype, tiles):
    """bfloat16 weights: past EXPERTS_MAX_ROWS_BF16 rows per expert (where the CPU has bf16 dot products) the experts
    run on forward_grouped's BLAS GEMMs, unless the C kernels run on AMX tiles (then every batch stays in C);
    float32 keeps the C kernel up to EXPERTS_MAX_ROWS; all paths agree (cpu/linear.py experts_max_rows)."""
    from wideep.cpu import gemm
    from wideep.cpu.linear import EXPERTS_MAX_ROWS, EXPERTS_MAX_ROWS_BF16, experts_max_rows
    from wideep.moe.experts import Experts
    from wideep.layers.kernels import Kernels
    from wideep.cpu.kernels import table
    if tiles and not gemm.amx_supported():
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    E, H, I, k = 8, 64, 32, 2
    ex = Experts(E, H, I, dtype=dtype, backend="cpu", kernels=Kernels.from_table("cpu", table()))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.05)
    T = 4 * EXPERTS_MAX_ROWS_BF16 * E // k   # 4x the bf16 limit, well under float32's
    x = torch.randn(T, H, dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    grouped = []
    real = Experts.forward_grouped
    before = gemm.amx()
    gemm.amx(tiles)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Experts, "forward_grouped", lambda self, *a: grouped.append(1) or real(self, *a))
            with torch.no_grad():
                got = ex.forward_cpu(x, ids, w)
                ref = ex.kernels.experts(x, ex.w13, ex.w2, ids, w, limit=ex.limit)
        limit = experts_max_rows(dtype, dtype)
    finally:
        gemm.amx(before)
    blas = dtype == torch.bfloat16 and gemm.bf16_dot_supported() and not tiles
    assert limit == (None if tiles else EXPERTS_MAX_ROWS_BF16 if blas else EXPERTS_MAX_ROWS)
    assert len(grouped) == int(blas)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
