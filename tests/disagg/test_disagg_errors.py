"""Disaggregation failure modes: a bad config is one clear error on every rank (before connecting
where possible); a prefill or a decode rank killed mid-run makes every other rank exit non-zero,
naming it, in time."""
from __future__ import annotations

import os
import signal

import pytest

from wideep.disagg.config import DisaggConfig
from tests.faults import sigkill_at_step
from tests.parallel.spawn import run

TIMEOUT_S = 20.0


def test_config_errors_show_the_numbers():
    with pytest.raises(ValueError, match=r"disagg.decode.ep_size \(1\) != disagg.decode.dp_size \(2\)"):
        DisaggConfig.from_dict({"decode": {"dp_size": 2, "ep_size": 1}})
    with pytest.raises(ValueError, match=r"unknown disagg.prefill keys \['tp_size'\]"):
        DisaggConfig.from_dict({"prefill": {"tp_size": 2}})
    with pytest.raises(ValueError, match=r"unknown disagg config keys \['pools'\]"):
        DisaggConfig.from_dict({"pools": 2})
    with pytest.raises(ValueError, match="disagg.prefill.max_num_seqs must be an integer >= 1, got 0"):
        DisaggConfig.from_dict({"prefill": {"max_num_seqs": 0}})
    with pytest.raises(ValueError, match="kv_transfer must be one of"):
        DisaggConfig.from_dict({"kv_transfer": "rdma"})
    cfg = DisaggConfig.from_dict({"prefill": {"dp_size": 3, "ep_size": 3}})
    with pytest.raises(ValueError, match=r"prefill.dp_size \(3\) \+ disagg.decode.dp_size \(1\) = 4 != world_size \(2\)"):
        cfg.validate(2)
    with pytest.raises(ValueError, match=r"n_routed_experts \(16\) is not divisible by disagg.prefill.ep_size \(3\)"):
        cfg.validate(4, 16)
    assert cfg.decode_ranks == [0] and cfg.prefill_ranks == [1, 2, 3] and cfg.role_of(0) == "decode"
    # ep_size defaults to the pool's dp_size
    assert DisaggConfig.from_dict({"prefill": {"dp_size": 2}, "decode": {"dp_size": 3}}).decode.ep_size == 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("disagg_err")), arch="v3", seed=3)


def _build(model_dir: str | dict, disagg_by_rank: dict, options_by_rank: dict) -> str:
    from wideep.disagg import make_engine
    rank = int(os.environ["RANK"])
    if isinstance(model_dir, dict):   # a copy of the checkpoint per rank
        model_dir = model_dir[rank]
    options = dict(options_by_rank.get(rank, {}))
    parallel = {"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5, **options.pop("parallel", {})}
    eng = make_engine(model_dir, disagg_by_rank.get(rank, disagg_by_rank["all"]), progress=False,
                      parallel=parallel, **options)
    eng.shutdown()
    return "built"


ONE_ONE = {"prefill": {"dp_size": 1, "ep_size": 1}, "decode": {"dp_size": 1, "ep_size": 1}}


@pytest.mark.multirank
@pytest.mark.parametrize("nprocs, disagg, options, message", [
    (3, {"all": ONE_ONE}, {}, "= 2 != world_size (3)"),
    (4, {"all": {"prefill": {"dp_size": 3, "ep_size": 3}}}, {},
     "n_routed_experts (16) is not divisible by disagg.prefill.ep_size (3)"),
    (2, {"all": ONE_ONE, 1: dict(ONE_ONE, decode={"max_num_seqs": 7})}, {}, "config mismatch: ranks [1]"),
    (2, {"all": dict(ONE_ONE, kv_transfer="nixl")}, {}, "kv_transfer backend 'nixl': no adapter is written yet"),
    (2, {"all": ONE_ONE}, {"all": {"max_num_seqs": 4}}, "max_num_seqs is set per pool"),
    (2, {"all": ONE_ONE}, {0: {"kv_cache_dtype": "fp8"}, "all": {}},   # the pools would cache latents differently
     "config mismatch: ranks [1]"),
    (2, {"all": ONE_ONE}, {0: {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}, "all": {}},
     "config mismatch: ranks [1]"),   # the pools would disagree about the MTP drafter's cache layer
    (2, {"all": ONE_ONE}, {"all": {"parallel": {"on_rank_loss": "continue"}}},
     'on_rank_loss = "continue" is not supported with prefill/decode disaggregation'),
])
def test_bad_config_fails_on_every_rank(tiny, nprocs, disagg, options, message):
    options = {r: options.get(r, options.get("all", {})) for r in range(nprocs)}
    outs = run(_build, nprocs, args=(tiny, disagg, options), timeout_s=90)
    for o in outs:
        assert o.returncode not in (0, None), (o.rank, o.stderr[-1500:])
        assert message in (o.error or o.stderr), (o.rank, (o.error or o.stderr)[-1500:])


@pytest.mark.multirank
def test_pools_caching_different_layer_counts_fail_on_every_rank(tiny, tmp_path):
    """The prefill rank's copy of the checkpoint has a layer less (or, with MTP, a drafter the other lacks): a
    transfer would send fewer payloads than the decode rank waits for. Once built, every rank names both counts."""
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    shallow = make_tiny_checkpoint(str(tmp_path / "shallow"), arch="v3", seed=3, num_hidden_layers=3)
    outs = run(_build, 2, args=({0: tiny, 1: shallow}, {"all": ONE_ONE}, {0: {}, 1: {}}), timeout_s=90)
    for o in outs:
        assert o.returncode not in (0, None), (o.rank, o.stderr[-1500:])
        err = o.error or o.stderr
        assert "the pools cache KV differently" in err and "in 4 layers" in err and "in 3 layers" in err, \
            (o.rank, err[-1500:])


def _serve_until_killed(model_dir: str, victim: int) -> None:
    from wideep.disagg import make_engine
    from wideep.engine import SamplingParams
    pools = {"prefill": {"dp_size": 1, "ep_size": 1}, "decode": {"dp_size": 2, "ep_size": 2}}
    eng = make_engine(model_dir, pools, progress=False, parallel={"timeout_s": TIMEOUT_S, "heartbeat_s": 0.5})
    if eng.roles.rank == victim:
        sigkill_at_step(3)
    if not eng.is_front:
        eng.run_worker_loop()
    else:
        for i in range(60):  # a stream of prompts: the prefill rank steps again and again
            eng.add_request(f"r{i}", [5 + i, 6, 7] * 10, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
            for _ in range(4):
                eng.step()
        while eng.has_unfinished_requests():
            eng.step()
    raise AssertionError("serving finished although a rank was killed")


@pytest.mark.multirank
@pytest.mark.parametrize("victim", [1, 2], ids=["decode", "prefill"])
def test_rank_killed_mid_serving_stops_everyone(tiny, victim):
    outs = run(_serve_until_killed, 3, args=(tiny, victim), timeout_s=TIMEOUT_S + 60)
    assert outs[victim].returncode == -signal.SIGKILL
    for o in outs:
        if o.rank == victim:
            continue
        assert o.returncode not in (0, None), o.stderr[-2000:]
        assert f"rank {victim} lost" in o.stderr + (o.error or ""), o.stderr[-2000:]
        assert o.elapsed_s - outs[victim].elapsed_s < TIMEOUT_S
