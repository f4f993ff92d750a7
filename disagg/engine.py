"""make_engine: build this rank's part of a disaggregated job (every rank calls it, SPMD).

    eng = make_engine(model_dir, disagg={"prefill": {"dp_size": 2, "ep_size": 2},
                                         "decode": {"dp_size": 2, "ep_size": 2}}, block_size=16, ...)
    if eng.is_front:            # global rank 0, a decode rank: Engine's API (add_request/step/abort/metrics)
        ...; eng.shutdown()
    else:
        eng.run_worker_loop()   # every other rank: the engine's step loop, in its pool's lockstep

Every check that can fail runs on every rank before anything connects (the same error everywhere):
the pool sizes against the world size and the experts; options that are set per pool; then, once
connected, that every rank got the same config, and that both pools cache latents in one dtype and
layout over as many layers (the checkpoints' layer counts, and the MTP drafter's layer, agree: a transfer
sends one payload per cached layer).
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from wideep.engine.model.families import family_of
from wideep.engine.model.model_config import ModelConfig
from wideep.parallel import ParallelConfig, bootstrap, check_agreement, fingerprint, launch_world_size
from wideep.parallel.watchdog import guard_collective

from .config import DisaggConfig
from .decode import DecodeHooks, DisaggEngine
from .kv_transfer import check_backend
from .prefill import PrefillHooks
from .roles import build_roles

_PER_POOL = ("dp_size", "ep_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_blocks")


def check_options(options: dict, par: dict) -> None:
    """Raise ValueError naming an option that cannot go with the pools (also before any rank starts: serve)."""
    for key in _PER_POOL:
        if options.get(key) is not None or (key in ("dp_size", "ep_size") and par.get(key) not in (None, "auto")):
            raise ValueError(f"{key} is set per pool when disaggregated: use [disagg.prefill] / [disagg.decode]")
    if par.get("on_rank_loss", "exit") != "exit":
        raise ValueError("[parallel] on_rank_loss = \"continue\" is not supported with prefill/decode "
                         "disaggregation yet (the pools would have to re-form and re-route transfers): use \"exit\"")
    if options.get("ctx") is not None:
        raise ValueError("ctx cannot be passed when disaggregated: make_engine bootstraps the job and its pools")
    for key in ("dbo", "eplb"):
        v = options.get(key)
        if v and (v is True or v == "auto" or (isinstance(v, dict) and v.get("enabled"))
                  or getattr(v, "enabled", False)):
            raise ValueError(f"{key} is not supported with prefill/decode disaggregation yet; disable [{key}]")


def make_engine(model: str, disagg, parallel=None, **options) -> DisaggEngine:
    """-> this rank's DisaggEngine: a decode rank (the front on global rank 0) or a prefill rank,
    each the engine's own step loop with the role's hooks."""
    cfg = DisaggConfig.coerce(disagg)
    par = dict(parallel.to_dict() if isinstance(parallel, ParallelConfig) else (parallel or {}))
    check_options(options, par)
    par = {k: v for k, v in par.items() if k not in ("dp_size", "ep_size")}
    mcfg = ModelConfig.from_dir(model)
    from wideep.engine.spec_decode import SpeculativeConfig
    spec = SpeculativeConfig.coerce(options.get("speculative_config", options.get("speculative")))
    if spec.method == "mtp":
        family_of(mcfg).refuse("speculative method 'mtp' with prefill/decode disaggregation")
    world = launch_world_size()
    if world < 2:
        raise ValueError(f"prefill/decode disaggregation needs at least 2 ranks (1 prefill + 1 decode); "
                         f"world_size is {world}")
    experts = mcfg.moe.n_routed_experts + par.get("num_redundant_experts", 0) if mcfg.moe else None
    cfg.validate(world, experts)
    check_backend(cfg.kv_transfer)
    ctx = bootstrap(ParallelConfig.from_dict(dict(par, dp_size=world, ep_size=world)))
    check_agreement(ctx, fingerprint([cfg.to_dict(), par, options]), "disagg config / engine options")
    roles = build_roles(ctx, cfg)
    pool_options = dict(options, parallel=par, **getattr(cfg, roles.role).engine_options())
    if roles.role == "prefill" and spec.method == "mtp":
        # every prompt's MTP rows must travel, and the last row drafts: no turning drafting off here by batch size
        # (the only thing that can on a rank that never verifies), which would leave rows in a stash
        pool_options.pop("speculative_config", None)
        pool_options["speculative"] = dataclasses.replace(spec, disable_by_batch_size=None)
    hooks = (DecodeHooks if roles.role == "decode" else PrefillHooks)(roles.kv, roles.rank)
    eng = DisaggEngine(model, roles, hooks, **pool_options)
    hooks.attach(eng.core)
    # every rank's cache shape (its layers, the MTP drafter's included), to validate prompts at the front and check
    # the pools agree
    mine = dict(eng.core.kv.describe(), role=roles.role)
    infos: list = [None] * ctx.world_size
    with guard_collective(ctx):
        dist.all_gather_object(infos, mine, group=ctx.cpu_group)
    if len({(i["dtype"], i["layout"]) for i in infos}) > 1:
        raise RuntimeError("the pools cache KV differently: " + ", ".join(
            f"rank {r} ({i['role']}) {i['dtype']}: {i['layout']}" for r, i in enumerate(infos)))
    pre = [i for i in infos if i["role"] == "prefill"]
    smallest = min(pre, key=lambda i: i["blocks"] * i["block_size"])
    eng.know_prefill_capacity(smallest["blocks"], smallest["block_size"])
    return eng
