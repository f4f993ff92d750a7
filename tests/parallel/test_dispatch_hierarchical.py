"""Two-level dispatch (parallel/dispatch/hierarchical.py) == the flat torch dispatcher on gloo ranks
laid out as nodes: 2 nodes x 2 ranks (4 ranks; also 1 x 4 and 4 x 1 on the same ranks) and
2 nodes x 4 ranks (8 ranks; also 4 x 2, 1 x 8). Normal and low-latency modes, inline and on a
communication thread, DBO's per-microbatch copies, ranks with no tokens, -1 slots; exact per-tier
byte counters (inter-node bytes = unique (token, other node) pairs x row bytes); the routing
histogram; the simulated network's tiers per round. The other layouts reuse the ranks: a dispatcher reads its nodes from the context only,
so a context with another ranks_per_node is that layout over the same process group."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.parallel.spawn import spawn
from tests.parallel.test_dispatch import fake_experts, make_inputs

H, P, K = 16, 16, 4  # hidden, physical experts, top-k (as test_dispatch)


def as_nodes(ctx, L: int):
    """The same ranks and groups, seen as nodes of L ranks."""
    return dataclasses.replace(ctx, local_world_size=L, num_nodes=ctx.world_size // L, node_rank=ctx.rank // L,
                               local_rank=ctx.rank % L)


def expected_bytes(data, rank: int, ep: int, L: int, row: int) -> dict:
    """Exact per-tier bytes of this rank's two-level and flat dispatch/combine, from every rank's inputs."""
    per = P // ep

    def ranks_of(ids_row):
        return {int(i) // per for i in ids_row if i >= 0}

    node, local = rank // L, rank % L
    out = {"flat_inter": 0, "flat_intra": 0, "inter": 0, "intra": 0, "combine_inter": 0, "combine_intra": 0}
    for _, ids, _ in [data[rank]]:
        for row_ids in ids:
            rs = ranks_of(row_ids)
            out["flat_inter"] += sum(r // L != node for r in rs)
            out["flat_intra"] += sum(r // L == node and r != rank for r in rs)
            out["inter"] += len({r // L for r in rs} - {node})          # unique (token, other node) pairs
    # forwarded by this rank: rows of its peers' tokens bound for other ranks of its node
    for s in range(local, ep, L):
        for row_ids in data[s][1]:
            out["intra"] += sum(r // L == node and r != rank for r in ranks_of(row_ids))
    # combine: partial sums back to other ranks of the node = the rows they forwarded to this rank;
    # one row per (token, this node) back to each source on another node
    for s in range(ep):
        for row_ids in data[s][1]:
            rs = ranks_of(row_ids)
            if rank in rs and s % L != local:
                out["combine_intra"] += 1
            if s % L == local and s // L != node and node in {r // L for r in rs}:
                out["combine_inter"] += 1
    return {k: v * row for k, v in out.items()}


def _battery(ep: int, layouts: tuple[int, ...]) -> dict:
    import torch.distributed as dist

    from wideep.parallel import ParallelConfig, StepPlan, bootstrap, make_dispatcher, shutdown
    from wideep.parallel.comm_stream import CommStream
    from wideep.parallel.dispatch.handles import HierarchicalHandle, HierarchicalLowLatencyHandle

    base = bootstrap(ParallelConfig(dp_size=ep, ep_size=ep, ranks_per_node=layouts[0], timeout_s=60))
    assert (base.ranks_per_node, base.num_nodes) == (layouts[0], ep // layouts[0])
    rank, per = base.rank, P // ep
    stream = CommStream()
    stream_group = dist.new_group(backend="gloo")
    cases = {4: [[5, 0, 17, 3], [0, 0, 0, 0], [40, 1, 0, 9]],
             8: [[5, 0, 17, 3, 9, 1, 0, 12], [0, 0, 0, 0, 0, 0, 0, 0], [21, 4, 0, 9, 2, 2, 30, 0]]}[ep]
    report = {"checks": 0, "auto": {}}
    for L in layouts:
        ctx = as_nodes(base, L)
        N = ep // L
        report["auto"][L] = type(make_dispatcher(ctx, P, H)).__name__
        flat = make_dispatcher(ctx, P, H, "torch", torch_low_latency_max_tokens=64)
        hier = make_dispatcher(ctx, P, H, "hierarchical", torch_low_latency_max_tokens=64)
        hier_stream = make_dispatcher(ctx, P, H, "hierarchical", torch_low_latency_max_tokens=64, stream=stream,
                                      group=stream_group)
        for ci, Ts in enumerate(cases):
            for dtype in (torch.float32, torch.bfloat16):
                data = make_inputs(1000 * ep + 10 * L + ci, Ts, dtype)
                x, ids, w = data[rank]
                tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
                row = H * x.element_size()
                want = expected_bytes(data, rank, ep, L, row)
                flat.stats.reset()
                got = flat.dispatch(x, ids, w)
                ref = flat.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, rank * per), got.handle)
                st = flat.stats
                assert (st.dispatch_bytes_inter, st.dispatch_bytes_intra) == (want["flat_inter"], want["flat_intra"])
                assert st.dispatch_bytes_remote == st.dispatch_bytes_inter + st.dispatch_bytes_intra
                meta_row = 2 * ids.shape[1] * 4   # a row's expert ids and weights (int32 each)
                # to other nodes: one int64 count per rank there, a metadata row per payload row
                assert st.meta_bytes_inter == 8 * (ep - L) + want["flat_inter"] // row * meta_row, st
                flat_rows = got.x.shape[0]
                for name, d in (("hier", hier), ("hier-stream", hier_stream)):
                    d.stats.reset()
                    d.routing.reset()
                    with torch.inference_mode(name == "hier-stream"):   # as the engine calls it
                        got = d.dispatch(x, ids, w)
                        out = d.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, rank * per), got.handle)
                    assert isinstance(got.handle, HierarchicalHandle)
                    # the experts get one row per (token, rank) pair, as from the flat dispatcher
                    assert got.x.shape[0] == flat_rows and (got.topk_ids >= 0).any(1).all()
                    assert ((got.topk_ids < 0) <= (got.topk_weights == 0)).all()
                    assert out.shape == (Ts[rank], H) and out.dtype == dtype
                    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"{name} L={L} {Ts} {dtype}: {m}")
                    st = d.stats
                    assert st.dispatch_bytes_inter == want["inter"], (name, L, st, want)
                    assert st.dispatch_bytes_intra == want["intra"], (name, L, st, want)
                    assert (st.combine_bytes_inter, st.combine_bytes_intra) == (want["combine_inter"],
                                                                                want["combine_intra"]), (st, want)
                    assert st.dispatch_calls == st.combine_calls == 1 and st.low_latency_calls == 0
                    # to other nodes: two int64 counts per rank there, a metadata row per stage-1 row
                    assert st.meta_bytes_inter == 16 * (ep - L) + want["inter"] // row * meta_row, (name, L, st)
                    # routing: how many nodes each of this rank's tokens touched
                    hist = [0] * (N + 1)
                    for row_ids in ids:
                        hist[len({int(i) // per // L for i in row_ids if i >= 0})] += 1
                    assert d.routing.tolist() == hist, (d.routing.tolist(), hist)
                # Low-latency mode: padded blocks, C rows to each peer, N*C rows to each rank of the node.
                plan = StepPlan.make(max(Ts), low_latency_max_tokens=64)
                for name, d in (("hier-ll", hier), ("hier-ll-stream", hier_stream)):
                    d.stats.reset()
                    with torch.inference_mode(name == "hier-ll-stream"):
                        got = d.dispatch(x, ids, w, plan)
                        out = d.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, rank * per), got.handle)
                    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"{name} L={L} {Ts} {dtype}: {m}")
                    C = max(Ts)
                    if C:
                        assert isinstance(got.handle, HierarchicalLowLatencyHandle) and got.x.shape == (ep * C, H)
                        st = d.stats
                        assert st.low_latency_calls == 1 and st.meta_bytes_inter == (N - 1) * C * meta_row
                        assert (st.dispatch_bytes_inter, st.dispatch_bytes_intra) == ((N - 1) * C * row,
                                                                                      (L - 1) * N * C * row)
                        assert (st.combine_bytes_inter, st.combine_bytes_intra) == ((N - 1) * C * row,
                                                                                    (L - 1) * N * C * row)
                report["checks"] += 1

        # Start/wait halves in flight at once, and DBO's per-microbatch copies (own groups, threads).
        x, ids, w = make_inputs(77 + L, [20] * ep)[rank]
        halves = [(x[:8], ids[:8], w[:8]), (x[8:], ids[8:], w[8:])]
        blocking = [flat.combine(fake_experts(g.x, g.topk_ids, g.topk_weights, rank * per), g.handle)
                    for g in (flat.dispatch(*mb) for mb in halves)]
        streams = [CommStream(), CommStream()]
        copies = [hier.for_microbatch(dist.new_group(backend="gloo"), s) for s in streams]
        for ds in ([hier, hier], copies):
            p0, p1 = ds[0].dispatch_start(*halves[0]), ds[1].dispatch_start(*halves[1])
            g1, g0 = p1.wait(), p0.wait()
            c0 = ds[0].combine_start(fake_experts(g0.x, g0.topk_ids, g0.topk_weights, rank * per), g0.handle)
            c1 = ds[1].combine_start(fake_experts(g1.x, g1.topk_ids, g1.topk_weights, rank * per), g1.handle)
            torch.testing.assert_close(c1.wait(), blocking[1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c0.wait(), blocking[0], atol=1e-5, rtol=1e-5)
        for s in streams:
            s.close()
        # The simulated network charges each round to the tiers it uses (latency only, so each delay
        # is exactly its tier's): flat = counts, payload, combine on every tier the group spans;
        # two-level = counts on both, stage 1 and its return inter-node, stage 2 and its return
        # intra-node, a tier of one rank (a local copy) nothing.
        from wideep.parallel.comm_stream import SimulatedLink, SimulatedNetwork
        lat = {"intra": 0.001, "inter": 0.004}
        both = max(lat["intra"] if L > 1 else 0, lat["inter"] if N > 1 else 0)
        want_delay = {"torch": 3 * both,
                      "hierarchical": both + 2 * (lat["inter"] if N > 1 else 0) + 2 * (lat["intra"] if L > 1 else 0)}
        for backend, want in want_delay.items():
            net = SimulatedNetwork(SimulatedLink(lat["intra"] * 1e6), SimulatedLink(lat["inter"] * 1e6))
            d = make_dispatcher(ctx, P, H, backend, link=net)
            g = d.dispatch(x, ids, w)
            d.combine(fake_experts(g.x, g.topk_ids, g.topk_weights, rank * per), g.handle)
            assert abs(net.delay_s - want) < 1e-6, (backend, L, net.delay_s, want)
        # A combine of the wrong rows fails on its own rank, before any collective.
        g = hier.dispatch(x, ids, w)
        try:
            hier.combine(g.x[:-1] if len(g.x) else torch.zeros(1, H), g.handle)
            report.setdefault("bad_combine", {})[L] = None
        except ValueError as e:
            report.setdefault("bad_combine", {})[L] = str(e)
        hier.combine(fake_experts(g.x, g.topk_ids, g.topk_weights, rank * per), g.handle)
    stream.close()
    shutdown(base)
    return report


def _check(reports, layouts, ep):
    for rep in reports:
        assert rep["checks"] == 6 * len(layouts)
        for L in layouts:
            assert rep["auto"][L] == ("HierarchicalDispatcher" if L < ep else "TorchDispatcher")
            assert "combine expects y" in rep["bad_combine"][L]


@pytest.mark.multirank
def test_two_level_equals_flat_2_nodes_x_2():
    layouts = (2, 4, 1)   # 2 x 2, then 1 node of 4, 4 nodes of 1
    _check(spawn(_battery, 4, args=(4, layouts), timeout_s=240), layouts, 4)


@pytest.mark.multirank
@pytest.mark.slow
def test_two_level_equals_flat_2_nodes_x_4():
    layouts = (4, 2)      # 2 x 4, then 4 x 2
    _check(spawn(_battery, 8, args=(8, layouts), timeout_s=420), layouts, 8)
