"""The torch KVTransfer on 2 gloo ranks: streams are independent (received out of order), a send is
not done before its receiver posts the receive (the back-pressure the decode side relies on), and
objects round-trip."""
from __future__ import annotations

import time

import pytest

from tests.parallel.spawn import spawn


def _rank() -> dict:
    import torch
    import torch.distributed as dist

    from wideep.disagg.kv_transfer import TorchKVTransfer, recv_object, send_object
    from wideep.parallel import ParallelConfig, bootstrap, shutdown
    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2, timeout_s=30))
    kv = TorchKVTransfer(ctx, dist.new_group(backend="gloo"))
    out = {}
    if ctx.rank == 0:
        big, small = torch.arange(300_000, dtype=torch.float32).view(1000, 300), torch.tensor([5.0, 6.0])
        h_big, h_small = kv.send_start(1, 7, big), kv.send_start(1, 3, small)
        hs = send_object(kv, 1, 9, {"lo": 0, "hi": 4, "last": True})
        time.sleep(1.0)  # rank 1 posts nothing for 1.5 s
        out["done_before_recv"] = [h_big.done(), h_small.done()] + [h.done() for h in hs]
        for h in [h_big, h_small] + hs:
            h.wait()
        out["done_after"] = [h_big.done(), h_small.done()]
        out["sent"] = kv.stats.bytes_sent
    else:
        time.sleep(1.5)
        small, big = torch.empty(2), torch.empty(1000, 300)
        kv.recv_start(0, 3, small).wait()  # posted in the other order than sent: streams are separate
        kv.recv_start(0, 7, big).wait()
        out["small"], out["big_ok"] = small.tolist(), bool(torch.equal(big.flatten(), torch.arange(300_000.0)))
        out["obj"] = recv_object(kv, 0, 9)
    dist.barrier(group=ctx.cpu_group)
    shutdown(ctx)
    return out


@pytest.mark.multirank
def test_streams_back_pressure_and_objects():
    a, b = spawn(_rank, 2, timeout_s=90)
    assert a["done_before_recv"] == [False] * 4 and a["done_after"] == [True, True]
    assert b["small"] == [5.0, 6.0] and b["big_ok"] and b["obj"] == {"lo": 0, "hi": 4, "last": True}
    assert a["sent"] >= 300_000 * 4 + 8
