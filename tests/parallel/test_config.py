"""ParallelConfig validation messages, single-process bootstrap, the one-rank dispatcher."""
from __future__ import annotations

import pytest
import torch

from wideep.parallel import (LocalDispatcher, ParallelConfig, ParallelContext, bootstrap, check_agreement,
                      make_dispatcher)


@pytest.mark.parametrize("cfg, world, experts, msg", [
    (dict(dp_size=4, ep_size=4), 4, 256 + 2,
     r"n_routed_experts \+ num_redundant_experts \(258\) is not divisible by ep_size \(4\)"),
    (dict(dp_size=3, ep_size=4), 4, None, r"dp_size \(3\) != world_size \(4\)"),
    (dict(dp_size=2, ep_size=4, tp_size=2), 4, None,
     r"attention tensor parallelism is not supported yet: tp_size \(2\)"),
    (dict(dp_size=4, ep_size=2), 4, None, r"ep_size \(2\) != world_size \(4\)"),
])
def test_validate_messages_show_numbers(cfg, world, experts, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelConfig(**cfg).validate(world, experts)


def test_validate_counts_redundant_experts():
    ParallelConfig(dp_size=4, ep_size=4, num_redundant_experts=4).validate(4, 256)
    with pytest.raises(ValueError, match=r"\(258\) is not divisible by ep_size \(4\)"):
        ParallelConfig(dp_size=4, ep_size=4, num_redundant_experts=2).validate(4, 256)


@pytest.mark.parametrize("kw, msg", [
    (dict(backend="mpi"), "backend must be one of"),
    (dict(dispatch_backend="nvshmem"), "dispatch_backend must be one of"),
    (dict(ep_size=0), r"ep_size must be an integer >= 1, got 0"),
    (dict(num_redundant_experts=-1), "num_redundant_experts"),
    (dict(timeout_s=4.0, heartbeat_s=3.0), r"heartbeat_s \(3.0\) is too long for timeout_s \(4.0\)"),
    (dict(torch_low_latency_max_tokens=-1), r"torch_low_latency_max_tokens must be an integer >= 0, got -1"),
    (dict(simulated_inter_node_gbps=-2.0), r"simulated link settings must be numbers >= 0, got "
                                           r"simulated_inter_node_gbps = -2.0"),
    (dict(simulated_latency_us="fast"), r"simulated_latency_us = 'fast'"),
])
def test_field_checks(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelConfig(**kw)


def test_from_dict_names_unknown_keys():
    assert ParallelConfig.from_dict({"dp_size": 2, "ep_size": 2}) == ParallelConfig(dp_size=2, ep_size=2)
    with pytest.raises(ValueError, match=r"unknown parallel config keys \['ep', 'tp'\]"):
        ParallelConfig.from_dict({"ep": 2, "tp": 1, "dp_size": 2})


def test_lost_after_bounds():
    assert ParallelConfig().lost_after_s == 5.0
    assert ParallelConfig(heartbeat_s=2.0).lost_after_s == 10.0
    assert ParallelConfig(timeout_s=6.0).lost_after_s == 3.0  # never past half the timeout


def test_bootstrap_without_launcher_is_single():
    ctx = bootstrap(ParallelConfig(backend="gloo"), env={})
    assert ctx.is_single and ctx.world_size == 1 and ctx.device == torch.device("cpu") and ctx.watchdog is None
    assert ctx.lost_ranks() == []
    check_agreement(ctx, "anything", "model config")  # no-op with one process


def test_bootstrap_errors_before_connecting():
    with pytest.raises(ValueError, match=r"dp_size \(2\) != world_size \(1\)"):
        bootstrap(ParallelConfig(dp_size=2, ep_size=2), env={})
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        bootstrap(ParallelConfig(dp_size=2, ep_size=2), env={"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"dp_size \(1\) != world_size \(2\)"):
        bootstrap(ParallelConfig(), env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": "1"})


def test_launch_rank_and_world_size_from_env():
    from wideep.parallel import launch_rank, launch_world_size
    assert (launch_rank({}), launch_world_size({})) == (0, 1)
    env = {"RANK": "3", "WORLD_SIZE": "4"}
    assert (launch_rank(env), launch_world_size(env)) == (3, 4)
    assert launch_rank({"PMI_RANK": "1"}) == 1 and launch_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        launch_rank({"RANK": "x"})


def test_local_dispatcher_passes_ids_through():
    ctx = ParallelContext.single()
    d = make_dispatcher(ctx, 8, 4)
    assert isinstance(d, LocalDispatcher)
    x, ids = torch.randn(3, 4), torch.tensor([[0, 7], [3, -1], [5, 5]])
    w = torch.rand(3, 2, dtype=torch.float64)
    got = d.dispatch(x, ids, w)
    assert got.x is x and torch.equal(got.topk_ids, ids) and got.topk_weights.dtype == torch.float32
    assert got.topk_weights[1, 1] == 0
    assert d.combine(got.x * 2, got.handle).shape == (3, 4)
    assert d.dispatch_start(torch.zeros(0, 4), ids[:0], w[:0]).wait().x.shape == (0, 4)
    assert d.stats.dispatch_calls == 2 and d.stats.combine_calls == 1
    d.stats.reset()
    assert d.stats.as_dict()["dispatch_calls"] == 0
    with pytest.raises(ValueError, match=r"x must be \[T, 4\], got \[3, 5\]"):
        d.dispatch(torch.randn(3, 5), ids, w)


def test_make_dispatcher_errors():
    ctx = ParallelContext.single()
    with pytest.raises(RuntimeError, match="dispatch backend 'deepep' needs the deep_ep package and CUDA: "):
        make_dispatcher(ParallelContext(world_size=2, ep_size=2), 8, 4, "deepep")
    assert isinstance(make_dispatcher(ctx, 8, 4, "deepep"), LocalDispatcher)  # one EP rank: nothing to move
    with pytest.raises(ValueError, match="dispatch backend must be"):
        make_dispatcher(ctx, 8, 4, "nccl")
    with pytest.raises(ValueError, match=r"num_physical_experts \(9\) is not divisible by ep_size \(2\)"):
        make_dispatcher(ParallelContext(world_size=2, ep_size=2), 9, 4, "torch")


def test_every_parallel_key_is_a_run_config_key():
    import dataclasses

    from wideep.launch.cli.run_config import validate
    keys = {f.name: getattr(ParallelConfig(), f.name) for f in dataclasses.fields(ParallelConfig)}
    assert validate({"model": {"path": "m"}, "parallel": keys})["parallel"]["ranks_per_node"] == 0
