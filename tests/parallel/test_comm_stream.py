"""Dispatch on a communication thread with a simulated link: same results as the plain torch
dispatcher; the link's delay is paid in full by a blocking call, hidden behind compute done
between start and wait, and counted from the rendezvous (a late peer does not hide it)."""
from __future__ import annotations

import time

import pytest
import torch

from wideep.parallel.comm_stream import SimulatedLink, SimulatedNetwork
from tests.parallel.spawn import spawn

LAT_US = 40_000  # large, so that scheduling noise on 2 shared cores cannot hide or fake it
LATE_S = 0.1


def _fake_experts(d):
    scale = ((d.topk_ids + 1).clamp(min=0).float() * d.topk_weights).sum(-1, keepdim=True)
    return d.x * scale


def _check() -> dict:
    import torch.distributed as dist

    from wideep.parallel import ParallelConfig, bootstrap, make_dispatcher, shutdown
    from wideep.parallel.comm_stream import CommStream
    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2))
    g = torch.Generator().manual_seed(ctx.rank)
    T, H, k, P = 7 + ctx.rank * 5, 16, 3, 8
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ids = torch.stack([torch.randperm(P, generator=g)[:k] for _ in range(T)])
    plain = make_dispatcher(ctx, P, H, "torch")
    stream = CommStream()
    linked = make_dispatcher(ctx, P, H, "torch", group=dist.new_group(backend="gloo"), stream=stream,
                             link=SimulatedLink(latency_us=LAT_US))
    d = plain.dispatch(x, ids, w)
    ref = plain.combine(_fake_experts(d), d.handle)
    t0 = time.perf_counter()
    d2 = linked.dispatch(x, ids, w)
    got = linked.combine(_fake_experts(d2), d2.handle)
    blocking_s = time.perf_counter() - t0            # counts + payload + combine: 3 link delays
    t0 = time.perf_counter()
    pend = linked.dispatch_start(x, ids, w)
    time.sleep(0.15)                                  # "compute" while the transfer is in flight
    pend.wait()
    overlapped_s = time.perf_counter() - t0
    # A late peer: rank 1 reaches combine LATE_S after rank 0. On a real link its rows leave when it
    # sends them, so rank 0 waits LATE_S + the latency — through the thread and the async path.
    async_linked = make_dispatcher(ctx, P, H, "torch", link=SimulatedLink(latency_us=LAT_US))
    late = {}
    for name, disp in (("stream", linked), ("async", async_linked)):
        d3 = disp.dispatch(x, ids, w)
        y = _fake_experts(d3)
        dist.barrier()
        if ctx.rank == 1:
            time.sleep(LATE_S)
        t0 = time.perf_counter()
        late[name] = (torch.equal(disp.combine(y, d3.handle), ref), time.perf_counter() - t0)
    stream.close()
    shutdown(ctx)
    return {"equal": torch.equal(got, ref), "blocking_s": blocking_s, "overlapped_s": overlapped_s,
            "late": late, "rank": ctx.rank}


@pytest.mark.multirank
def test_stream_with_simulated_link():
    for r in spawn(_check, 2, timeout_s=90):
        assert r["equal"]
        assert r["blocking_s"] >= 3 * LAT_US * 1e-6
        # 2 link delays (80 ms) fit inside the 150 ms of compute: the wait adds little
        assert r["overlapped_s"] < 0.15 + 0.06, r
        for name, (equal, seconds) in r["late"].items():
            assert equal, name
            if r["rank"] == 0:   # waited for the late peer, then for the link
                assert seconds >= LATE_S + 0.9 * LAT_US * 1e-6, (name, seconds)


def test_link_arithmetic():
    link = SimulatedLink(latency_us=200, gbps=8)
    assert link.transfer_s(10**6) == pytest.approx(200e-6 + 1e-3)
    # the bandwidth is shared: two transfers that meet at t=0 take the wire one after the other,
    # their latencies overlap; one that starts after the wire is free waits for nobody
    assert link.deliver_at(0.0, 10**6) == pytest.approx(1e-3 + 200e-6)
    assert link.deliver_at(0.0, 10**6) == pytest.approx(2e-3 + 200e-6)
    assert link.deliver_at(5.0, 10**6) == pytest.approx(5.0 + 1e-3 + 200e-6)
    latency_only = SimulatedLink(latency_us=300)
    assert latency_only.deliver_at(1.0, 10**9) == latency_only.deliver_at(1.0, 10**9) == pytest.approx(1.0003)
    assert not SimulatedLink().enabled
    with pytest.raises(ValueError):
        SimulatedLink(latency_us=-1)


def test_two_tier_network():
    from wideep.parallel import ParallelConfig
    net = SimulatedNetwork(SimulatedLink(latency_us=10, gbps=80), SimulatedLink(latency_us=100, gbps=20))
    # the tiers run in parallel: the slower decides; an unused tier (None) costs nothing, not even latency
    assert net.transfer_s(10**6, 10**6) == pytest.approx(100e-6 + 4e-4)
    assert net.transfer_s(10**6, None) == pytest.approx(10e-6 + 1e-4)
    assert net.transfer_s(None, 0) == pytest.approx(100e-6)
    assert net.deliver_at(2.0, None, None) == 2.0
    # each tier queues its own transfers: the intra-node wire is free while the inter-node one is busy
    assert net.deliver_at(0.0, None, 10**6) == pytest.approx(4e-4 + 100e-6)
    assert net.deliver_at(0.0, 10**6, None) == pytest.approx(1e-4 + 10e-6)
    assert net.deliver_at(0.0, None, 10**6) == pytest.approx(8e-4 + 100e-6)
    # one link for both tiers (a plain SimulatedLink): one transfer of all the bytes, as before tiers
    one = SimulatedNetwork.of(SimulatedLink(latency_us=50, gbps=8))
    assert one.transfer_s(10**6, 10**6) == pytest.approx(50e-6 + 2e-3)
    assert SimulatedNetwork.of(SimulatedLink()) is None and SimulatedNetwork.of(None) is None
    # from [parallel]: the inter-node tier defaults to the intra-node one; off when all are 0
    assert SimulatedNetwork.from_config(ParallelConfig()) is None
    cfg = SimulatedNetwork.from_config(ParallelConfig(simulated_latency_us=5, simulated_gbps=400,
                                                      simulated_inter_node_latency_us=20, simulated_inter_node_gbps=100))
    assert (cfg.intra.latency_s, cfg.intra.gbps, cfg.inter.latency_s, cfg.inter.gbps) == pytest.approx(
        (5e-6, 400, 20e-6, 100))
    same = SimulatedNetwork.from_config(ParallelConfig(simulated_latency_us=7))
    assert same.inter.latency_s == same.intra.latency_s == pytest.approx(7e-6) and same.inter.gbps == 0


def test_link_is_fixed_at_construction():
    """A dispatcher's simulated network is a constructor argument, shared by its microbatch copies and
    never reassigned: a run on another network builds other dispatchers (bench/dbo.py builds a core)."""
    from wideep.parallel.context import ParallelContext
    from wideep.parallel.dispatch.hierarchical import HierarchicalDispatcher
    from wideep.parallel.dispatch.torch_normal import TorchDispatcher
    ctx = ParallelContext(world_size=2, dp_size=2, ep_size=2)   # no process group: nothing is sent here
    net = SimulatedNetwork(SimulatedLink(latency_us=5))
    for cls in (TorchDispatcher, HierarchicalDispatcher):
        d = cls(ctx, 4, 8, link=net)
        assert d.link is net and d.for_microbatch(None, None).link is net
        with pytest.raises(AttributeError):
            d.link = None
    assert TorchDispatcher(ctx, 4, 8, link=SimulatedLink()).link is None   # a link that adds nothing: off
