"""Offline API shaped like vLLM's: `LLM(model, **options).generate(prompts, SamplingParams(...))`.

Under torchrun/mpirun (or with dp_size/ep_size > 1) every rank constructs the same LLM and calls
`generate` with the same prompts (SPMD): requests are spread over the DP ranks, attention runs on
the rank that owns the request, experts run where they live, and every rank gets all results back
in input order.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import asdict
from typing import Sequence as Seq

import torch

from attention_mla.kv_cache import BlockAllocator, LatentKVPool
from parallel.context import ParallelContext

from .build import load_model, parse_dtype
from .config import ModelConfig
from .runner import ModelRunner
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .spmd import StepSync, assign_requests, gather_outputs


def _load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


class LLM:
    """Options: dtype, device, max_model_len (default max_position_embeddings), block_size,
    kv_cache_blocks (default: enough for max_num_seqs sequences of max_model_len, capped by
    kv_cache_memory bytes), max_num_seqs, max_num_batched_tokens, seed; parallel: dp_size, ep_size,
    dispatch_backend, parallel (a ParallelConfig or dict of its fields), ctx (an existing ParallelContext).
    """

    def __init__(self, model: str, dtype: str | torch.dtype = "float32", device: str | None = None, *,
                 max_model_len: int | None = None, block_size: int = 64, kv_cache_blocks: int | None = None,
                 kv_cache_memory: int = 1 << 30, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 seed: int = 0, progress: bool = True, dp_size: int | None = None, ep_size: int | None = None,
                 dispatch_backend: str | None = None, parallel=None, ctx: ParallelContext | None = None):
        from parallel import ParallelConfig, bootstrap, check_agreement, fingerprint, launch_world_size
        cfg = ModelConfig.from_dir(model)
        par = parallel.to_dict() if isinstance(parallel, ParallelConfig) else dict(parallel or {})
        par.update({k: v for k, v in (("dp_size", dp_size), ("ep_size", ep_size),
                                      ("dispatch_backend", dispatch_backend)) if v is not None})
        if ctx is None:
            world = launch_world_size()
            # sizes not given follow the launcher, so one script or config serves 1 and N ranks
            par.setdefault("dp_size", world)
            par.setdefault("ep_size", world)
            pcfg = ParallelConfig.from_dict(par)
            n_experts = cfg.moe.n_routed_experts if cfg.moe else None
            pcfg.validate(world, n_experts)  # before connecting: the same error on every rank
            ctx = bootstrap(pcfg) if world > 1 else ParallelContext.single()
        else:
            par.setdefault("dp_size", ctx.dp_size)
            par.setdefault("ep_size", ctx.ep_size)
            pcfg = ParallelConfig.from_dict(par)
        self.ctx, self.pcfg = ctx, pcfg
        if not ctx.is_single:
            options = dict(dtype=str(dtype), max_model_len=max_model_len, block_size=block_size,
                           kv_cache_blocks=kv_cache_blocks, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, seed=seed)
            check_agreement(ctx, fingerprint([asdict(cfg), pcfg.to_dict(), options]), "model config / engine options")
        device = device or str(self.ctx.device)
        self.model_dir = model
        self.model = load_model(model, parse_dtype(dtype), device, progress and self.ctx.rank == 0, self.ctx,
                                pcfg.dispatch_backend, cfg)
        self.config = cfg
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) > max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        dt = self.model.dtype
        per_block = cfg.num_hidden_layers * block_size * cfg.mla.latent_dim * torch.empty(0, dtype=dt).element_size()
        if kv_cache_blocks is None:
            want = max_num_seqs * -(-self.max_model_len // block_size)
            kv_cache_blocks = max(1, min(want, kv_cache_memory // per_block))
        self.kv = LatentKVPool(cfg.num_hidden_layers, kv_cache_blocks, block_size, cfg.mla.latent_dim, dt, device)
        self.scheduler = Scheduler(BlockAllocator(kv_cache_blocks), block_size, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv)
        self.sync = StepSync(self.ctx)
        self.tokenizer = _load_tokenizer(model)
        self._ids = itertools.count()
        self._generator = torch.Generator(device=device).manual_seed(seed + self.ctx.rank)

    # -- requests ----------------------------------------------------------------------------
    def _make_sequence(self, prompt: str | Seq[int], params: SamplingParams) -> Sequence:
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is a string but {self.model_dir!r} has no tokenizer.json; pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt).ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        V = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, vocab_size={V})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is max_model_len={self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"(max_model_len={self.max_model_len})")
        gen = None
        if not params.greedy:
            gen = (torch.Generator(device=self.model.device).manual_seed(params.seed)
                   if params.seed is not None else self._generator)
        seq = Sequence(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids, params=params,
                       max_tokens=max_tokens, eos_token_ids=self.config.eos_token_ids, generator=gen,
                       logprobs=[] if params.logprobs is not None else None)
        return seq

    def _output(self, s: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(s.output_token_ids) if self.tokenizer is not None else ""
        comp = CompletionOutput(index=0, text=text, token_ids=list(s.output_token_ids),
                                cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                finish_reason=s.finish_reason)
        return RequestOutput(request_id=s.request_id, prompt=s.prompt, prompt_token_ids=s.prompt_token_ids,
                             prompt_logprobs=s.prompt_logprobs, outputs=[comp], finished=s.finished)

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
        # Validate everything before accepting anything; every rank sees the same prompts, so a bad
        # one raises the same error on every rank before any collective.
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, params)]
        for s in seqs:
            s.request_id = str(next(self._ids))
        per_rank = assign_requests([s.num_tokens + s.max_tokens for s in seqs], self.ctx.dp_size)
        self.last_assignment = [0] * len(seqs)  # DP rank of each request, for reports
        for r, idx in enumerate(per_rank):
            for i in idx:
                self.last_assignment[i] = r
        mine = per_rank[self.ctx.dp_rank]
        for i in mine:
            self.scheduler.add(seqs[i])
        self._run_until_done()
        local = {i: self._output(seqs[i]) for i in mine}
        return gather_outputs(self.ctx, local, len(seqs))

    def _run_until_done(self) -> None:
        while self.sync.anyone_has_work(self.scheduler.has_work()):
            batch = self.scheduler.schedule()
            if batch.seqs:
                self.runner.execute(batch)
            elif self.ctx.is_single:
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
            else:
                self.runner.dummy_step()  # keep the MoE all-to-alls in lockstep
            for s in batch.seqs:
                if s.finished:
                    self.scheduler.finish(s)

    def stats(self) -> dict:
        """This rank's parameter bytes and dispatch counters."""
        out = {"rank": self.ctx.rank, "param_bytes": self.model.param_bytes()}
        d = getattr(self.model, "dispatcher", None)
        if d is not None:
            out["dispatch"] = d.stats.as_dict()
        return out

    def all_stats(self) -> list[dict]:
        """Collective: every rank's stats(), in rank order, on every rank."""
        return gather_outputs(self.ctx, {self.ctx.rank: self.stats()}, self.ctx.world_size)

    def shutdown(self) -> None:
        if not self.ctx.is_single:
            from parallel import shutdown
            shutdown(self.ctx)
