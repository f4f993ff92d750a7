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

from parallel.watchdog import guard_collective

from .engine import Engine
from .sampling_params import RequestOutput, SamplingParams


class LLM:
    """Options: see Engine (dtype, device, max_model_len, block_size, kv_cache_blocks, kv_cache_memory,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, seed, dp_size, ep_size,
    dispatch_backend, parallel, ctx, experts_backend, attention_backend, max_logprobs); disagg (a disagg.DisaggConfig
    or [disagg] dict) serves with separate prefill and decode pools, whose sizes and batch limits it holds."""

    def __init__(self, model: str, **options):
        self.disaggregated = options.get("disagg") is not None
        if self.disaggregated:  # prefill/decode pools (disagg/): rank 0 is the front, in the decode pool
            from disagg import make_engine
            self.engine = make_engine(model, **options)
        else:
            self.engine = Engine(model, **options)
        core = self.engine.core
        self.ctx = getattr(self.engine, "job_ctx", core.ctx)
        self.config, self.model, self.tokenizer = core.config, core.model, core.tokenizer
        self.max_model_len = core.max_model_len
        self._batch = itertools.count()
        self.last_assignment: list[int] = []

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns outputs in input order.
        Collective when multi-rank: every rank passes the same prompts and gets every output."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        core, eng = self.engine.core, self.engine
        # Validate everything before accepting anything. Every rank sees the same prompts, so a bad one
        # raises the same error on every rank before any collective.
        if self.disaggregated:  # only the front knows both pools' limits: it checks, everyone raises
            error = None
            if eng.is_front:
                try:
                    for p, sp in zip(prompts, params):
                        eng.validate(core.tokenize(p)[1], sp)
                except ValueError as e:
                    error = str(e)
            box = [error]
            with guard_collective(self.ctx):
                dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
            if box[0] is not None:
                raise ValueError(box[0])
        for p, sp in ([] if self.disaggregated else zip(prompts, params)):
            core.validate(core.tokenize(p)[1], sp)
        batch = next(self._batch)
        ids = [f"llm-{batch}-{i}" for i in range(len(prompts))]
        results: list[RequestOutput | None] = [None] * len(prompts)
        if eng.is_front:
            for rid, p, sp in zip(ids, prompts, params):
                eng.add_request(rid, p, dataclasses.replace(sp, output_kind="final_only"))
            self.last_assignment = [eng._owner[rid] for rid in ids]
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
        return out

    def all_stats(self) -> list[dict]:
        """Collective: every rank's stats(), in rank order, on every rank."""
        from .spmd import gather_outputs
        return gather_outputs(self.ctx, {self.ctx.rank: self.stats()}, self.ctx.world_size)

    def shutdown(self) -> None:
        if not self.ctx.is_single:
            from parallel import shutdown
            shutdown(self.ctx)
