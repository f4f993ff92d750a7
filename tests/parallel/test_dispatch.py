"""Dispatch/combine on 2 and 4 gloo ranks: torch (normal and low-latency mode, inline and on a
communication thread) == allgather == one process, dedup and padded byte counts, T = 0 ranks,
start/wait halves (also on DBO's per-microbatch copies), the mode taken from each call's StepPlan,
plus the start-up agreement check. One spawn per ep size: every
check runs inside the ranks (an assertion there fails the test with that rank's traceback)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.spawn import spawn

H, P, K = 16, 16, 4  # hidden, physical experts, top-k


def make_inputs(seed: int, Ts: list[int], dtype=torch.float32):
    """Every rank's (x [T,H], topk_ids [T,K] physical with some -1, topk_weights [T,K]), identically
    on every rank, so each can compute what it should receive."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in Ts:
        x = torch.randn(T, H, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(P, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
        ids = ids.masked_fill(torch.rand(T, K, generator=g) < 0.15, -1)
        out.append((x, ids, torch.rand(T, K, generator=g)))
    return out


def fake_experts(x, local_ids, weights, first_global: int):
    """Expert g maps x to x*(g+1) + g (distinct per expert, so a wrong id or row shows);
    rows [R,H] -> weighted sum over the row's valid slots. first_global: global id of local 0."""
    valid = local_ids >= 0
    g = torch.where(valid, local_ids + first_global, 0).float()
    w = weights.float() * valid
    y = x.float() * (w * (g + 1)).sum(1, keepdim=True) + (w * g).sum(1, keepdim=True)
    return y.to(x.dtype)


def unique_pairs(ids, per: int) -> torch.Tensor:
    """[T, ep?] -> set of (token, dest rank) pairs as a [n, 2] tensor."""
    t, j = (ids >= 0).nonzero(as_tuple=True)
    return torch.unique(torch.stack([t, ids[t, j] // per], 1), dim=0)


def _battery(ep: int) -> dict:
    import torch.distributed as dist

    from wideep.parallel import ParallelConfig, StepPlan, bootstrap, check_agreement, make_dispatcher, shutdown

    ctx = bootstrap(ParallelConfig(dp_size=ep, ep_size=ep, timeout_s=30))
    rank, per = ctx.rank, P // ep
    assert (ctx.rank, ctx.world_size, ctx.ep_rank, ctx.dp_rank) == (int(os.environ["RANK"]), ep, rank, rank)
    assert ctx.backend == "gloo" and ctx.device.type == "cpu" and ctx.cpu_group is dist.group.WORLD
    assert ctx.launcher == "torchrun" and ctx.watchdog is not None and ctx.lost_ranks() == []
    assert torch.get_num_threads() == 1

    from wideep.parallel.dispatch.handles import TorchHandle, TorchLowLatencyHandle
    torch_d = make_dispatcher(ctx, P, H)
    assert type(torch_d).__name__ == "TorchDispatcher"  # auto on CPU
    ag_d = make_dispatcher(ctx, P, H, "allgather")
    from wideep.parallel.comm_stream import CommStream
    stream = CommStream()
    ll_d = make_dispatcher(ctx, P, H, "torch", torch_low_latency_max_tokens=64)
    ll_stream_d = make_dispatcher(ctx, P, H, "torch", torch_low_latency_max_tokens=64, stream=stream,
                                  group=dist.new_group(backend="gloo"))
    cases = {2: [[7, 0], [0, 0], [33, 12]], 4: [[5, 0, 17, 3], [0, 0, 0, 0], [40, 1, 0, 9]]}[ep]
    report = {"cases": 0}
    for ci, Ts in enumerate(cases):
        for dtype in (torch.float32, torch.bfloat16):
            data = make_inputs(100 * ep + ci, Ts, dtype)
            x, ids, w = data[rank]
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
            ref = fake_experts(x, ids, w, 0)  # one process: every expert local, local id = physical id
            outs = {}
            for name, d in (("torch", torch_d), ("allgather", ag_d)):
                d.stats.reset()
                got = d.dispatch(x, ids, w)
                assert got.topk_ids.dtype == torch.long and got.topk_weights.dtype == torch.float32
                assert ((got.topk_ids < 0) <= (got.topk_weights == 0)).all(), "weight must be 0 where id is -1"
                outs[name] = d.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, rank * per), got.handle)
                assert outs[name].shape == (Ts[rank], H) and outs[name].dtype == dtype
                torch.testing.assert_close(outs[name], ref, **tol, msg=lambda m: f"{name} case {Ts} {dtype}: {m}")
                if name == "torch":
                    # Each token goes once to each rank holding any of its experts, and only there.
                    elt = x.element_size()
                    pairs = unique_pairs(ids, per)
                    expect_r = sum(int((unique_pairs(i, per)[:, 1] == rank).sum()) for _, i, _ in data)
                    assert got.x.shape[0] == expect_r, (got.x.shape, expect_r)
                    assert (got.topk_ids >= 0).any(1).all(), "a row was sent to a rank without its experts"
                    st = torch_d.stats
                    assert st.dispatch_bytes == len(pairs) * H * elt, (st, len(pairs))
                    assert st.dispatch_bytes_remote == int((pairs[:, 1] != rank).sum()) * H * elt
                    assert st.combine_bytes == expect_r * H * elt and st.meta_bytes > 0
                    assert st.dispatch_calls == st.combine_calls == 1
            torch.testing.assert_close(outs["torch"], outs["allgather"], **tol)
            # Low-latency mode (planned capacity, one padded message each way), inline and on a thread.
            for name, d in (("ll", ll_d), ("ll-stream", ll_stream_d)):
                plan = StepPlan.make(max(Ts), low_latency_max_tokens=d.low_latency_max_tokens)
                assert plan.low_latency == (max(Ts) > 0)
                d.stats.reset()
                got = d.dispatch(x, ids, w, plan)
                out = d.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, rank * per), got.handle)
                torch.testing.assert_close(out, outs["torch"], **tol, msg=lambda m: f"{name} {Ts} {dtype}: {m}")
                C = max(Ts)
                if C:
                    assert got.x.shape == (ep * C, H)       # padded: C rows from every rank
                    assert d.stats.dispatch_bytes == ep * C * H * x.element_size()
                    assert d.stats.dispatch_bytes_remote == (ep - 1) * C * H * x.element_size()
                    assert d.stats.low_latency_calls == 1 and isinstance(got.handle, TorchLowLatencyHandle)
            report["cases"] += 1

    # A step planned too small fails on the rank that has more tokens (here: every rank), no hang.
    x, ids, w = make_inputs(3, [6] * ep)[rank]
    try:
        ll_d.dispatch(x, ids, w, StepPlan.make(4, low_latency_max_tokens=64))
        report["overflow"] = None
    except ValueError as e:
        report["overflow"] = str(e)
    # The mode is the call's: a normal-mode plan right after runs normal mode (nothing to reset).
    ll_d.stats.reset()
    got = ll_d.dispatch(x, ids, w, StepPlan.make(6))
    assert isinstance(got.handle, TorchHandle) and ll_d.stats.low_latency_calls == 0
    ll_d.combine(fake_experts(got.x, got.topk_ids, got.topk_weights, rank * per), got.handle)

    # Start/wait halves: two microbatches in flight at once, waited out of order == the blocking calls.
    x, ids, w = make_inputs(7, [20] * ep)[rank]
    halves = [(x[:8], ids[:8], w[:8]), (x[8:], ids[8:], w[8:])]
    for d in (torch_d, ag_d):
        blocking = [d.combine(fake_experts(g.x, g.topk_ids, g.topk_weights, rank * per), g.handle)
                    for g in (d.dispatch(*mb) for mb in halves)]
        p0, p1 = d.dispatch_start(*halves[0]), d.dispatch_start(*halves[1])
        g1, g0 = p1.wait(), p0.wait()
        assert p0.wait() is g0  # wait is idempotent
        c0 = d.combine_start(fake_experts(g0.x, g0.topk_ids, g0.topk_weights, rank * per), g0.handle)
        c1 = d.combine_start(fake_experts(g1.x, g1.topk_ids, g1.topk_weights, rank * per), g1.handle)
        torch.testing.assert_close(c1.wait(), blocking[1], atol=0, rtol=0)
        torch.testing.assert_close(c0.wait(), blocking[0], atol=0, rtol=0)
        # DBO's per-microbatch copies (each over its own process group), both in flight at once.
        mbs = [d.for_microbatch(dist.new_group(backend="gloo"), None) for _ in halves]
        assert [type(m) for m in mbs] == [type(d)] * 2 and mbs[0].group is not mbs[1].group
        p0, p1 = mbs[0].dispatch_start(*halves[0]), mbs[1].dispatch_start(*halves[1])
        g1, g0 = p1.wait(), p0.wait()
        c0 = mbs[0].combine_start(fake_experts(g0.x, g0.topk_ids, g0.topk_weights, rank * per), g0.handle)
        c1 = mbs[1].combine_start(fake_experts(g1.x, g1.topk_ids, g1.topk_weights, rank * per), g1.handle)
        torch.testing.assert_close(c1.wait(), blocking[1], atol=0, rtol=0)
        torch.testing.assert_close(c0.wait(), blocking[0], atol=0, rtol=0)

    # Start-up agreement: equal passes; a differing rank makes every rank raise the same error.
    check_agreement(ctx, '{"model": "tiny"}', "model config")
    odd = rank % 2 == 1
    try:
        check_agreement(ctx, '{"model": "%s"}' % ("other" if odd else "tiny"), "model config")
        report["mismatch"] = None
    except RuntimeError as e:
        report["mismatch"] = str(e)
    stream.close()
    shutdown(ctx)
    return report


@pytest.mark.multirank
@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_battery(ep):
    reports = spawn(_battery, ep, args=(ep,), timeout_s=120)
    odd = [r for r in range(ep) if r % 2]
    for rep in reports:
        assert rep["cases"] == 6
        assert "planned for at most 4 per rank" in rep["overflow"]
        assert rep["mismatch"] is not None, "a rank did not see the config mismatch"
        assert rep["mismatch"].startswith(f"config mismatch: ranks {odd} have a different model config than rank 0")
