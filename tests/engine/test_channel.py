"""The control channel's names (engine/worker/channel.py): the ranks agree on each engine's name
without counting engines; two engines' channels open in one process never cross; an engine built
after earlier ones closed, and a run started again, get names of their own, so none reads an
earlier channel's addresses from the store."""
from __future__ import annotations

import time

import pytest

from tests.parallel.spawn import spawn


def _wait(end, n: int, timeout_s: float = 20.0) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += end.recv(0.2)
    return out


def _open(ctx, name: str):
    from wideep.engine.worker.channel import FrontChannel, RankChannel
    rank_end = RankChannel(ctx, name)
    front = FrontChannel(ctx, list(range(ctx.world_size)), name) if ctx.rank == 0 else None
    return front, rank_end


def _exchange(ctx, chans: dict) -> tuple[dict, dict]:
    """Over every channel at once: the front sends each rank the channel's name, each rank reports
    it back -> (what this rank heard per channel, what the front heard per channel)."""
    import torch.distributed as dist
    for name, (front, _) in chans.items():
        if front is not None:
            for r in range(ctx.world_size):
                front.send(r, name)
    heard = {name: _wait(rank_end, 1) for name, (_, rank_end) in chans.items()}
    for name, (_, rank_end) in chans.items():
        rank_end.report((name, ctx.rank))
    reports = {name: sorted(_wait(front, ctx.world_size)) for name, (front, _) in chans.items() if front is not None}
    dist.barrier(group=ctx.cpu_group)
    for front, rank_end in chans.values():
        rank_end.close()
        if front is not None:
            front.close()
    return heard, reports


def _rank() -> dict:
    from wideep.engine.worker.channel import agree_name
    from wideep.parallel import ParallelConfig, bootstrap, shutdown
    ctx = bootstrap(ParallelConfig(dp_size=2, ep_size=2, timeout_s=30.0))
    a, b = agree_name(ctx), agree_name(ctx)        # two engines in one process, open together
    first = _exchange(ctx, {a: _open(ctx, a), b: _open(ctx, b)})
    c = agree_name(ctx)                              # built after both closed, on the same store
    later = _exchange(ctx, {c: _open(ctx, c)})
    shutdown(ctx)
    return {"names": [a, b, c], "first": first, "later": later}


@pytest.mark.multirank
def test_ranks_agree_on_fresh_names_and_channels_never_cross():
    runs = [spawn(_rank, 2, timeout_s=120) for _ in range(2)]   # the second: the run started again
    for ranks in runs:
        names = ranks[0]["names"]
        assert all(r["names"] == names for r in ranks), [r["names"] for r in ranks]
        assert len(set(names)) == 3, names
        a, b, c = names
        for r, out in enumerate(ranks):
            assert out["first"][0] == {a: [a], b: [b]}, f"rank {r} heard {out['first'][0]}"
            assert out["later"][0] == {c: [c]}, f"rank {r} heard {out['later'][0]}"
        assert ranks[0]["first"][1] == {a: [(a, 0), (a, 1)], b: [(b, 0), (b, 1)]}
        assert ranks[0]["later"][1] == {c: [(c, 0), (c, 1)]}
    assert not set(runs[0][0]["names"]) & set(runs[1][0]["names"])
