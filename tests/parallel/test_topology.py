"""Topology: node-major layout arithmetic and its errors, simulated nodes ([parallel] ranks_per_node),
and two torchrun launchers on one host standing in for two nodes; node groups all-reduce."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from wideep.parallel import ParallelConfig, bootstrap
from wideep.parallel.topology import Topology
from tests.parallel.spawn import spawn


def test_layout_is_node_major():
    t = Topology(rank=5, world_size=8, ranks_per_node=4)
    assert (t.node_rank, t.local_rank, t.num_nodes) == (1, 1, 2)
    assert t.node_ranks() == [4, 5, 6, 7] and t.node_ranks(0) == [0, 1, 2, 3]
    assert Topology.from_launcher(5, 8, 1, 4, node_rank=1) == t
    assert Topology.from_launcher(5, 8, 1, 4) == t                  # no GROUP_RANK: rank // local size
    assert t.simulate(2).node_ranks() == [4, 5] and t.simulate(2).num_nodes == 4


@pytest.mark.parametrize("call, msg", [
    (lambda: Topology.from_launcher(0, 4, 0, 3), r"reports 3 ranks on this node, which does not divide world_size \(4\)"),
    (lambda: Topology.from_launcher(5, 8, 1, 4, node_rank=0),
     r"placed rank 5 as local rank 1 of node 0 with 4 ranks per node; ranks must be node-major"),
    (lambda: Topology(0, 4, 1).simulate(3), r"ranks_per_node \(3\) does not divide world_size \(4\)"),
    (lambda: Topology(0, 8, 4).simulate(8), r"ranks_per_node \(8\) must divide the 4 ranks per node the launcher"),
    (lambda: ParallelConfig(dp_size=4, ep_size=4, ranks_per_node=3).validate(4),
     r"ranks_per_node \(3\) does not divide world_size \(4\)"),
    (lambda: ParallelConfig(ranks_per_node=-1), r"ranks_per_node must be an integer >= 0"),
])
def test_layout_errors_show_the_numbers(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_bootstrap_rejects_a_launcher_layout_before_connecting():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match=r"placed rank 1 as local rank 1 of node 1 with 2 ranks per node"):
        bootstrap(ParallelConfig(dp_size=4, ep_size=4), env=env)


def _topology_report(ranks_per_node: int) -> dict:
    import torch.distributed as dist

    from wideep.parallel import guard_collective, shutdown

    world = int(os.environ["WORLD_SIZE"])
    ctx = bootstrap(ParallelConfig(dp_size=world, ep_size=world, timeout_s=60, ranks_per_node=ranks_per_node))
    t = torch.tensor([float(ctx.rank)])
    with guard_collective(ctx):
        dist.all_reduce(t, group=ctx.node_group)
    info = dict(rank=ctx.rank, node=ctx.node_rank, local=ctx.local_rank, nodes=ctx.num_nodes,
                per_node=ctx.ranks_per_node, node_group_size=dist.get_world_size(ctx.node_group),
                node_sum=t.item(), launcher=ctx.launcher, group_rank=os.environ.get("GROUP_RANK"),
                agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    shutdown(ctx)
    return info


def _expected(world: int, per_node: int) -> list[dict]:
    return [dict(rank=r, node=r // per_node, local=r % per_node, nodes=world // per_node, per_node=per_node,
                 node_group_size=per_node, node_sum=float(sum(range(r // per_node * per_node, (r // per_node + 1) * per_node))))
            for r in range(world)]


def _core(infos: list[dict]) -> list[dict]:
    keys = ("rank", "node", "local", "nodes", "per_node", "node_group_size", "node_sum")
    return [{k: i[k] for k in keys} for i in infos]


@pytest.mark.multirank
def test_simulated_nodes_have_working_node_groups():
    infos = spawn(_topology_report, 4, args=(2,), timeout_s=90)
    assert _core(infos) == _expected(4, 2)


@pytest.mark.multirank
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_two_torchrun_launchers_on_one_host_are_two_nodes():
    """`torchrun --nnodes 2 --node-rank i --nproc-per-node 2 --master-addr 127.0.0.1` twice: node 0's
    agent hosts the store; every rank sees its node from GROUP_RANK and all-reduces in its node."""
    infos = spawn(_topology_report, 4, args=(0,), launcher="torchrun", nnodes=2, timeout_s=150)
    assert _core(infos) == _expected(4, 2)
    assert [i["group_rank"] for i in infos] == ["0", "0", "1", "1"]
    assert all(i["launcher"] == "torchrun" and i["agent_store"] == "True" for i in infos)


def _eplb_node_count(model_dir: str) -> dict:
    """Hierarchical EPLB on 4 ranks laid out as 2 simulated nodes: it plans for 2 nodes."""
    from wideep.eplb import EplbConfig
    from tests.eplb.helpers import build_llm, generate

    cfg = EplbConfig(enabled=True, num_redundant_experts=4, window_size=64, step_interval=10**9, policy="hierarchical")
    llm, ctl = build_llm(model_dir, cfg, dp_size=4, ep_size=4, parallel={"timeout_s": 60.0, "ranks_per_node": 2})
    generate(llm)
    record = ctl.rebalance()                 # plans with the hierarchical policy over 2 nodes
    out = dict(num_nodes=ctl.dump_stats(None)["num_nodes"], node=llm.ctx.node_rank, rebalanced=record is not None)
    llm.shutdown()
    return out


@pytest.mark.multirank
def test_hierarchical_eplb_takes_its_node_count_from_the_topology(tmp_path):
    from tests.eplb.helpers import make_skewed_checkpoint

    d = make_skewed_checkpoint(str(tmp_path))
    outs = spawn(_eplb_node_count, 4, args=(d,), timeout_s=240)
    assert [o["node"] for o in outs] == [0, 0, 1, 1]
    assert all(o["num_nodes"] == 2 and o["rebalanced"] for o in outs), outs
