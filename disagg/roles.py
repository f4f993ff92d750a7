"""Split the job into a prefill pool and a decode pool: process groups and per-pool contexts.

Every rank creates every group in the same order (dist.new_group is collective over the world):
each pool's device group (its MoE all-to-all) and gloo group (its step sync), then one gloo group
over all ranks used only for KV transfer. A pool's ParallelContext looks like a whole job to the engine
code inside it (rank = index in the pool, world_size = pool size, dp = ep = pool), so EngineCore,
the dispatcher and the step sync run unchanged, confined to the pool.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from wideep.parallel.context import ParallelContext

from .config import DisaggConfig
from .kv_transfer import TorchKVTransfer, make_kv_transfer


@dataclass
class Roles:
    role: str                    # "prefill" | "decode"
    rank: int                    # global rank
    ranks: list[int]             # global ranks of this rank's pool
    ctx: ParallelContext         # the whole job
    pool_ctx: ParallelContext    # this pool only
    kv: TorchKVTransfer
    cfg: DisaggConfig

    @property
    def leader(self) -> int:
        """The pool's first global rank (the source of its broadcasts)."""
        return self.ranks[0]


def pool_nodes(ranks: list[int], ranks_per_node: int, i: int) -> dict:
    """A pool's own node layout (its ranks on the world's nodes; global rank r is on node r // L): the
    pool's ranks node-major with the same count on each of its nodes -> those nodes; otherwise (a pool
    spread unevenly) one flat node. -> ParallelContext fields for pool rank i.

        pool_nodes([4, 5, 6, 7], 2, 3) == dict(local_rank=1, local_world_size=2, node_rank=1, num_nodes=2)
        pool_nodes([1], 2, 0)          == dict(local_rank=0, local_world_size=1, node_rank=0, num_nodes=1)
    """
    nodes = [r // ranks_per_node for r in ranks]
    distinct = sorted(set(nodes))
    per = len(ranks) // len(distinct)
    if nodes == sorted(nodes) and all(nodes.count(n) == per for n in distinct):
        return dict(local_rank=i % per, local_world_size=per, node_rank=i // per, num_nodes=len(distinct))
    return dict(local_rank=i, local_world_size=len(ranks), node_rank=0, num_nodes=1)


def build_roles(ctx: ParallelContext, cfg: DisaggConfig) -> Roles:
    timeout = timedelta(seconds=ctx.timeout_s)
    gloo = ctx.backend == "gloo"
    groups = {}
    for name, ranks in (("decode", cfg.decode_ranks), ("prefill", cfg.prefill_ranks)):
        dev = dist.new_group(ranks, backend=ctx.backend, timeout=timeout)
        cpu = dev if gloo else dist.new_group(ranks, backend="gloo", timeout=timeout)
        groups[name] = (ranks, dev, cpu)
    kv_group = dist.new_group(backend="gloo", timeout=timeout)  # see kv_transfer.py for why gloo
    role = cfg.role_of(ctx.rank)
    ranks, dev, cpu = groups[role]
    i = ranks.index(ctx.rank)
    nodes = pool_nodes(ranks, ctx.ranks_per_node, i)
    pool = dataclasses.replace(ctx, rank=i, world_size=len(ranks), dp_rank=i, dp_size=len(ranks), ep_rank=i,
                               ep_size=len(ranks), ep_group=dev, cpu_group=cpu,
                               node_group=dev if nodes["num_nodes"] == 1 else None, **nodes)
    return Roles(role, ctx.rank, ranks, ctx, pool, make_kv_transfer(cfg.kv_transfer, ctx, kv_group), cfg)
