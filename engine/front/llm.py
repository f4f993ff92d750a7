"""Offline API shaped like vLLM's: `LLM(model, **options).generate(prompts, SamplingParams(...))`,
a thin loop over Engine.

Under torchrun/mpirun (or with dp_size/ep_size > 1) every rank constructs the same LLM and calls
`generate` with the same prompts (SPMD): rank 0 feeds the engine, the other ranks follow its
steps, and every rank gets all results back in input order.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch.distributed as dist

from wideep.parallel.watchdog import guard_collective

from ..generation_defaults import generation_defaults
from ..sampling_params import RequestOutput, SamplingParams
from .engine import Engine


class LLM:
    """Options: see Engine (engine/engine_config.py). engine: an already built engine with Engine's
    front API (add_request / step / validate / end_worker_loop / run_worker_loop), used instead of
    building one (wideep.LLM passes a disaggregated one)."""

    def __init__(self, model: str, engine=None, **options):
        if "disagg" in options:
            raise ValueError("disagg= is served by wideep.LLM (from wideep import LLM): the engine package "
                             "does not build prefill/decode pools")
        self.engine = engine if engine is not None else Engine(model, **options)
        core = self.engine.core
        self.ctx = self.engine.job_ctx
        self.config, self.model, self.tokenizer = core.config, core.model, core.tokenizer
        self.max_model_len = core.max_model_len
        self._batch = itertools.count()
        self._defaults = generation_defaults(core.model_dir)
        self.last_assignment: list[int] = []

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's name); what
        generate() uses when it is given none."""
        return SamplingParams(**self._defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns outputs in input order.
        Collective when multi-rank: every rank passes the same prompts and gets every output."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        core, eng = self.engine.core, self.engine
        # Validate everything before accepting anything: the front checks (it knows every pool's
        # limits) and every rank raises its verdict, before any request is sent.
        error = None
        if eng.is_front:
            try:
                for p, sp in zip(prompts, params):
                    eng.validate(core.tokenize(p)[1], sp)
            except ValueError as e:
                error = str(e)
        if not self.ctx.is_single:
            box = [error]
            with guard_collective(self.ctx):
                dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
            error = box[0]
        if error is not None:
            raise ValueError(error)
        batch = next(self._batch)
        ids = [f"llm-{batch}-{i}" for i in range(len(prompts))]
        results: list[RequestOutput | None] = [None] * len(prompts)
        if eng.is_front:
            for rid, p, sp in zip(ids, prompts, params):
                eng.add_request(rid, p, dataclasses.replace(sp, output_kind="final_only"))
            self.last_assignment = [eng.front.rank_of(rid) for rid in ids]
            index = {rid: i for i, rid in enumerate(ids)}
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        results[index[out.request_id]] = out
            eng.end_worker_loop()
        else:
            eng.run_worker_loop()
        if not self.ctx.is_single:
            box = [(results, self.last_assignment)]
            with guard_collective(self.ctx):
                dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
            results, self.last_assignment = box[0]
        return results

    def stats(self) -> dict:
        """This rank's parameter bytes and dispatch counters."""
        out = {"rank": self.ctx.rank, "param_bytes": self.model.param_bytes()}
        d = self.model.dispatcher
        if d is not None:
            out["dispatch"] = d.stats.as_dict()
        out.update(self.engine.extra_stats())
        return out

    def all_stats(self) -> list[dict]:
        """Collective: every rank's stats(), in rank order, on every rank."""
        from ..worker.step_sync import gather_outputs
        return gather_outputs(self.ctx, {self.ctx.rank: self.stats()}, self.ctx.world_size)

    def shutdown(self) -> None:
        """Collective: every rank closes its engine and leaves the process group."""
        self.engine.close()
