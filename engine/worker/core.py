"""One rank's engine parts, built from one EngineConfig: parallel context, model, paged latent cache,
block manager, scheduler, runner, step sync, EPLB and DBO; request validation and admission.

The step loop (engine/worker/rank_loop.py) drives these; the front (engine/front/front.py) validates with them.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import threading
from dataclasses import asdict
from typing import Sequence as Seq

import torch

from wideep.attention_mla.fp8_cache import latent_layout
from wideep.attention_v4.fp8 import V4_KV_CACHE_DTYPES
from wideep.attention_mla.kv_cache import LatentKVPool
from wideep.kvstore.events import HeldLog
from wideep.parallel.context import ParallelContext

from ..engine_config import EngineConfig
from ..model.build import load_model, parse_dtype
from ..model.model_config import ModelConfig
from ..sampling_params import SamplingParams
from ..sched.block_manager import BlockManager
from ..sched.scheduler import Scheduler
from ..sched.v4_blocks import V4BlockManager
from ..sched.sequence import Sequence
from .messages import NewRequest
from .runner import ModelRunner
from .v4_runner import V4Runner, V4StreamCache
from .step_sync import StepSync


def _load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def freeze_startup_heap() -> None:
    """The start-up heap (torch, the model, the tokenizer: ~10^5 objects) lives as long as the engine:
    frozen, the cyclic GC's full collections stop walking it every few steps of big batches (as vLLM
    does; bench/host_overhead.py). Unfrozen at exit, so that the final collection still reaches it."""
    gc.collect()
    gc.freeze()
    if not getattr(freeze_startup_heap, "registered", False):
        atexit.register(gc.unfreeze)
        freeze_startup_heap.registered = True


def connect(cfg: EngineConfig, mcfg: ModelConfig) -> ParallelContext:
    """Validate the layout against the launcher's world size and the experts (the same error on every
    rank, before connecting), then join the other ranks — or one process, CUDA when present."""
    from wideep.parallel import bootstrap, launch_world_size
    world = launch_world_size()
    pcfg = cfg.parallel
    if cfg.eplb.num_redundant_experts or pcfg.num_redundant_experts:
        pcfg = dataclasses.replace(pcfg, num_redundant_experts=cfg.eplb.redundant_with(pcfg.num_redundant_experts))
    pcfg.validate(world, mcfg.moe.n_routed_experts if mcfg.moe else None)
    if world > 1:
        return bootstrap(pcfg)
    return ParallelContext.single("cuda" if torch.cuda.is_available() else "cpu")


def refuse_v4(cfg: EngineConfig) -> None:
    """What the engine does not do with DeepSeek-V4's KV streams yet: an error now, not wrong tokens later."""
    why = [(cfg.kv_cache_dtype not in V4_KV_CACHE_DTYPES,
            f"kv_cache_dtype {cfg.kv_cache_dtype!r} (V4 streams are kept in the model dtype or fp8: 'auto', 'fp8')")]
    bad = [w for on, w in why if on]
    if bad:
        raise ValueError("DeepSeek-V4 does not support " + "; ".join(bad) + " yet")


def _is_decode(num_tokens: list[int]) -> bool:
    """A step of decodes only (one token per sequence): the DBO auto switch times these apart."""
    return bool(num_tokens) and all(n == 1 for n in num_tokens)


class EngineCore:
    def __init__(self, cfg: EngineConfig, ctx: ParallelContext | None = None, progress: bool = True):
        self.cfg = cfg
        mcfg = self.config = ModelConfig.from_dir(cfg.model)
        if mcfg.v4 is not None:
            refuse_v4(cfg)
        self.ctx = ctx = ctx if ctx is not None else connect(cfg, mcfg)
        if not ctx.is_single:
            from wideep.parallel import check_agreement, fingerprint
            check_agreement(ctx, fingerprint([asdict(mcfg), cfg.to_dict()]), "model config / engine config")
        self.model_dir = cfg.model
        device = cfg.device or str(ctx.device)
        pcfg = cfg.parallel
        from wideep.parallel.comm_stream import SimulatedNetwork
        self.dispatch_options = dict(low_latency_max_tokens=pcfg.deepep_low_latency_max_tokens,
                                     torch_low_latency_max_tokens=pcfg.torch_low_latency_max_tokens,
                                     link=SimulatedNetwork.from_config(pcfg))
        self.model = load_model(cfg.model, parse_dtype(cfg.dtype), device, progress and ctx.rank == 0, ctx,
                                pcfg.dispatch_backend, mcfg, num_redundant_experts=pcfg.num_redundant_experts,
                                eplb=cfg.eplb, experts_backend=cfg.experts_backend,
                                attention_backend=cfg.attention_backend, dispatch_options=self.dispatch_options,
                                kv_cache_dtype=cfg.kv_cache_dtype, fuse_decode_stack=cfg.fuse_decode_stack,
                                mtp=cfg.speculative.method == "mtp", quantization=cfg.quantization,
                                mtp_dtype=(parse_dtype(cfg.speculative.draft_dtype) if cfg.speculative.draft_dtype
                                           else None))
        self.eplb = None
        if cfg.eplb.enabled and mcfg.moe is not None:
            from wideep.eplb.controller import EplbController
            self.eplb = EplbController(self.model, ctx, cfg.eplb)
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) > max_position_embeddings "
                             f"({mcfg.max_position_embeddings})")
        self.kv = self._kv_cache(device)
        log = HeldLog(enabled=cfg.enable_prefix_caching and cfg.kv_cache.routing == "kv_aware")
        self.store = self._kv_store(log) if cfg.kv_cache.tiers else None
        if mcfg.v4 is None:
            self.blocks = BlockManager(self.kv.num_blocks, cfg.block_size, cfg.enable_prefix_caching, self.store, log)
        else:   # one pool per stream (DBO may cut a chunk between microbatches: window blocks for all of it)
            self.blocks = V4BlockManager(self.kv.geometry, self.kv.num_blocks, cfg.max_num_seqs,
                                         cfg.max_num_batched_tokens, whole_chunks=self._dbo_on(), on_free=self.kv.drop,
                                         enable_prefix_caching=cfg.enable_prefix_caching, log=log, store=self.store)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        if cfg.speculative.enabled:
            from ..spec_decode.speculator import Speculator
            self.scheduler.speculator = Speculator(cfg.speculative)
        overlap, self.auto = None, None
        if self._dbo_on():
            from wideep.dbo.overlap import Overlap
            overlap = Overlap(self.model, ctx)  # collective: every rank builds its groups
            if cfg.dbo.enabled == "auto":
                from wideep.dbo.auto import AutoSwitch
                self.auto = AutoSwitch()
        self.runner = (ModelRunner if mcfg.v4 is None else V4Runner)(self.model, self.kv, overlap)
        self.runner.grammars = lambda: self.grammars
        k = cfg.speculative.num_speculative_tokens
        if getattr(self.model, "drafter", None) is not None or (mcfg.v4 is not None and cfg.speculative.method == "mtp"):
            if mcfg.v4 is None:
                from .mtp_drafter import MTPDrafter
                self.runner.drafter = MTPDrafter(self.model.drafter, self.kv, k)
            else:   # MTP block 0, its window in layer L of the pools
                from .v4_mtp_drafter import V4MTPDrafter
                self.runner.drafter = V4MTPDrafter(self.model, self.kv, k)
            self.runner.speculator = self.scheduler.speculator
            self.scheduler.lookahead = k - 1
        self.split_steps = 0
        self._plan_declined = getattr(self.model, "decode_plan_declined", None)   # why no CPU decode plan (V4)
        self.declined_decode_steps = 0
        self._nodes_seen = self._nodes_step = None   # routing histograms: cumulative, and of the last step
        d = self.model.dispatcher
        self.sync = StepSync(ctx, d.low_latency_max_tokens if d is not None else 0)
        self.tokenizer = _load_tokenizer(cfg.model)
        self._generator = torch.Generator(device=device).manual_seed(cfg.seed + ctx.rank)
        self._grammars = None            # structured/compiler.GrammarCompiler, built for the first constrained request
        self._grammars_lock = threading.Lock()
        self.compiling: list[tuple[Sequence, object]] = []   # (sequence, its grammar's Future), not scheduled yet
        freeze_startup_heap()

    @classmethod
    def from_options(cls, model: str, ctx: ParallelContext | None = None, progress: bool = True,
                     **options) -> "EngineCore":
        """EngineConfig.from_options; with a ctx, the sizes default to its own."""
        if ctx is not None:
            par = options.get("parallel")
            par = dict(par.to_dict() if hasattr(par, "to_dict") else (par or {}))
            par.setdefault("dp_size", ctx.dp_size)
            par.setdefault("ep_size", ctx.ep_size)
            options["parallel"] = par
        world = ctx.world_size if ctx is not None else None
        return cls(EngineConfig.from_options(model, world_size=world, **options), ctx, progress)

    def _dbo_on(self) -> bool:
        """Whether steps may be split into two microbatches (dbo.enabled true or "auto", a MoE model)."""
        return bool(self.cfg.dbo.enabled) and self.config.moe is not None

    def _kv_cache(self, device) -> LatentKVPool | V4StreamCache:
        cfg, mcfg, dt = self.cfg, self.config, self.model.dtype
        if mcfg.v4 is not None:
            return V4StreamCache(self.model, cfg.kv_cache_memory, cfg.block_size, cfg.max_num_seqs, self.max_model_len,
                                 cfg.max_num_batched_tokens, cfg.kv_cache_blocks, cfg.enable_prefix_caching,
                                 cfg.kv_cache_dtype, mtp_layers=int(cfg.speculative.method == "mtp"))
        index_dim = mcfg.dsa.index_head_dim if mcfg.dsa is not None else 0   # DSA: indexer keys beside the latents
        layers = mcfg.num_hidden_layers + (self.model.drafter is not None)   # the MTP drafter's own latents last
        fp8 = latent_layout(cfg.kv_cache_dtype, mcfg.mla.kv_lora_rank, mcfg.mla.qk_rope_head_dim, dt)
        blocks = cfg.kv_cache_blocks
        if blocks is None:
            per_block = LatentKVPool.bytes_per_block(layers, cfg.block_size, mcfg.mla.latent_dim, dt,
                                                     index_dim, fp8)
            want = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
            blocks = max(1, min(want, cfg.kv_cache_memory // per_block))
        return LatentKVPool(layers, blocks, cfg.block_size, mcfg.mla.latent_dim, dt, device,
                            index_dim=index_dim, fp8=fp8)

    def _kv_store(self, log: HeldLog):
        """The tiers below the device cache ([kv_cache] tiers): every per-layer pool's block rows (DeepSeek-V4: a
        store per stream)."""
        from wideep.kvstore.identity import model_identity
        from wideep.kvstore.store import TieredStore
        cfg = self.cfg
        if self.config.v4 is not None:
            return self._v4_stores(log)
        pools = self.kv.all_pools()   # every per-layer tensor: the latents, and DSA's keys
        identity = None
        if "disk" in cfg.kv_cache.tiers:
            # the cache dtype by name (an fp8 tier never serves a full-precision cache, nor the reverse),
            # with the model dtype its RoPE part is stored in
            fp8 = self.kv.fp8
            dtype = str(pools[0].dtype) if fp8 is None else f"{self.kv.kv_cache_dtype}+rope:{fp8.rope_dtype}"
            identity = model_identity(cfg.model, dtype, cfg.block_size,
                                      [(cfg.block_size, p.shape[1]) for p in pools])
        return TieredStore(cfg.kv_cache, pools, cfg.block_size, identity, prefer=self.ctx.dp_rank, log=log)

    def _v4_stores(self, log: HeldLog):
        from wideep.kvstore.identity import model_identity
        from wideep.kvstore.streams import StreamStores, block_rows
        cfg, g = self.cfg, self.kv.geometry
        pools = self.kv.stream_pools()
        identities = None
        if "disk" in cfg.kv_cache.tiers:   # a directory per stream: its blocks' layout and the cache dtype
            dtype = f"v4:{self.kv.kv_cache_dtype}:{self.model.dtype}"
            identities = {s: model_identity(cfg.model, f"{dtype}:{s}", cfg.block_size,
                                            [tuple(r.shape[1:]) for r in block_rows(ps)]) for s, ps in pools.items()}
        return StreamStores(cfg.kv_cache, pools, {s: g.tokens_per_block(s) for s in pools}, identities,
                            prefer=self.ctx.dp_rank, log=log)

    def take_kv_events(self):
        """-> kvstore.KVEvents: the blocks this rank started or stopped holding since it last said
        (bounded per call), or None."""
        return self.blocks.take_events()

    def has_kv_events(self) -> bool:
        return self.blocks.log.pending

    def close(self) -> None:
        """Release the KV tiers (persisting them to the disk tier first when configured)."""
        if self.store is not None:
            self.store.close(self.blocks.cached_blocks())
            self.store = self.blocks.store = None
        if self._grammars is not None:
            self._grammars.close()

    # -- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is a string but {self.model_dir!r} has no tokenizer.json; pass token ids")
            return prompt, self.tokenizer.encode(prompt).ids
        try:
            return None, [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model; -> its max_tokens (filled in when None)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        V = self.config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.cfg.max_logprobs:
                raise ValueError(f"{name}={n} is more than max_logprobs={self.cfg.max_logprobs} (an engine option: "
                                 f"max_logprobs=, [engine] max_logprobs, --max-logprobs)")
            if n is not None and n > V:
                raise ValueError(f"{name}={n} is more than the vocabulary (vocab_size={V})")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, vocab_size={V})")
        bad = [t for t in params.logit_bias or () if not 0 <= t < V]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of range [0, vocab_size={V})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is max_model_len={self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"(max_model_len={self.max_model_len})")
        why = self.blocks.capacity_error(len(ids) + max_tokens - 1)
        if why is not None:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) {why}")
        return max_tokens

    def make_sequence(self, req: NewRequest) -> Sequence:
        """A request's sequence on this rank. req.extra["resume"] (re-admitted after its rank was
        lost): the tokens the front already had, their cumulative logprob and, for seeded sampling,
        the generator's state after them — the sequence recomputes its KV and goes on from there."""
        params = req.params
        gen = None
        if not params.greedy:
            gen = (torch.Generator(device=self.model.device).manual_seed(params.seed)
                   if params.seed is not None else self._generator)
        seq = Sequence(request_id=req.request_id, prompt=None, prompt_token_ids=list(req.ids), params=params,
                       max_tokens=req.max_tokens, eos_token_ids=self.config.eos_token_ids, generator=gen,
                       logprobs=[] if params.logprobs is not None else None, arrival_time=req.arrival)
        resume = req.extra.get("resume")
        if resume:
            done = list(resume["output_ids"])
            seq.output_token_ids, seq.num_reported = done, len(done)
            seq.cumulative_logprob = resume["cumulative_logprob"]
            if seq.logprobs is not None:
                seq.logprobs = [None] * len(done)   # the front has them; only later ones are reported
            if resume.get("generator_state") is not None and gen is not None:
                gen.set_state(torch.frombuffer(bytearray(resume["generator_state"]), dtype=torch.uint8))
        return seq

    def add_request(self, req: NewRequest) -> Sequence:
        seq = self.make_sequence(req)
        spec = seq.params.structured_outputs
        if spec is not None:   # waits beside the scheduler while its grammar compiles (admit_compiled)
            self.compiling.append((seq, self.grammars.submit(spec)))
        else:
            self.scheduler.add(seq)
        return seq

    # -- structured outputs ---------------------------------------------------------------------------
    @property
    def grammars(self):
        """This process's structured/compiler.GrammarCompiler (the front's too, on rank 0)."""
        with self._grammars_lock:   # the front's event loop and the engine thread may both ask first
            if self._grammars is None:
                from wideep.structured.compiler import GrammarCompiler
                self._grammars = GrammarCompiler.build(self.cfg.structured_outputs_backend, self.tokenizer,
                                                       self.config.vocab_size)
        return self._grammars

    def check_grammar(self, params: SamplingParams) -> None:
        """The front, before admitting: compile (or find cached) the request's grammar; ValueError if bad."""
        if params.structured_outputs is not None:
            self.grammars.get(params.structured_outputs)

    def admit_compiled(self) -> list[Sequence]:
        """Before each step: sequences whose grammar is ready join the scheduler. -> those that
        finished instead (a grammar that failed here: aborted, to be reported)."""
        if not self.compiling or not any(f.done() for _, f in self.compiling):
            return []
        failed, waiting = [], []
        for seq, fut in self.compiling:
            if not fut.done():
                waiting.append((seq, fut))
            elif fut.exception() is not None:
                seq.abort()
                failed.append(seq)
            else:
                self.scheduler.add(seq)
        self.compiling = waiting
        return failed

    def abort(self, request_id: str) -> Sequence | None:
        """Abort a request held here (scheduled, or waiting for its grammar); None if it is not here."""
        for i, (seq, _) in enumerate(self.compiling):
            if seq.request_id == request_id:
                del self.compiling[i]
                seq.abort()
                return seq
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling)

    # -- around each step ----------------------------------------------------------------------------
    def split_votes(self, num_tokens: list[int]) -> tuple[bool, bool]:
        """DBO: (this rank may split its step, this rank votes to split). Only rank 0's vote counts."""
        if self.runner.overlap is None:
            return False, False
        from wideep.dbo.split import can_split
        ok = can_split(num_tokens, self.cfg.dbo.split) if num_tokens else True  # an idle rank never blocks a split
        if self.auto is None:
            return ok, True
        return ok, self.auto.decide(sum(num_tokens), _is_decode(num_tokens))

    def dispatchers(self) -> list:
        """The model's dispatcher and DBO's microbatch dispatchers, each once (DeepEP's is shared)."""
        overlap = self.runner.overlap.dispatchers if self.runner.overlap is not None else []
        return list({id(d): d for d in [self.model.dispatcher, *overlap] if d is not None}.values())

    def after_step(self, num_tokens: list[int], split: bool, seconds: float) -> None:
        """Every rank, after every step that ran (dummy steps included): EPLB's step counter and
        load window (a rebalance, when due, is collective), and the DBO auto switch's timings."""
        self.split_steps += split
        if self._plan_declined is not None and num_tokens and _is_decode(num_tokens):
            self.declined_decode_steps += 1
        from wideep.parallel.dispatch.routing import total_counts
        seen = total_counts(self.dispatchers())   # on the device: no sync
        if seen is not None:
            self._nodes_step = seen - self._nodes_seen if self._nodes_seen is not None else seen
            self._nodes_seen = seen
        if self.eplb is not None:
            self.eplb.after_step(sum(num_tokens))
        if self.auto is not None:
            self.auto.record(sum(num_tokens), _is_decode(num_tokens), split, seconds)

    def stats(self) -> dict:
        """This rank's scheduler and cache state, plus cumulative MoE all-to-all bytes (this rank's
        sends, DBO's microbatch dispatchers included; dispatch_bytes_remote = _intra (to its node's
        ranks) + _inter (to other nodes)), the routing histograms (moe_nodes_per_token[j]: (token,
        MoE layer) dispatches that touched j nodes, since start and in the last step;
        parallel/dispatch/routing.py), DBO split steps and EPLB rebalances."""
        b = self.blocks
        out = {"dp_rank": self.ctx.origin_rank, "running": len(self.scheduler.running),
               "waiting": len(self.scheduler.waiting) + len(self.scheduler.loading) + len(self.compiling),
               "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free, "kv_blocks_total": b.num_blocks, **b.usage(),
               "prefix_queried_tokens": b.queried_tokens, "prefix_hit_tokens": b.hit_tokens,
               "prefill_tokens": self.scheduler.prefill_tokens, "kv_device_cached_blocks": b.num_cached,
               "kv_device_cached_bytes": b.num_cached * sum(p[:b.block_size].nbytes for p in self.kv.pools),
               **{f"kv_hit_blocks_{tier}": n for tier, n in b.hit_blocks.items()},
               "preemptions": self.scheduler.num_preemptions, "dbo_split_steps": self.split_steps,
               "kv_bytes_per_token": self.kv.bytes_per_token(), "kv_cache_dtype": self.kv.kv_cache_dtype}
        if self.store is not None:
            out.update(self.store.stats())
        disp = self.dispatchers()
        if disp:
            for key in ("remote", "intra", "inter"):
                out[f"dispatch_bytes_{key}"] = sum(getattr(d.stats, f"dispatch_bytes_{key}")
                                                   + getattr(d.stats, f"combine_bytes_{key}") for d in disp)
            if self._nodes_seen is not None:   # SYNC: two small histograms, when stats are reported
                out["moe_nodes_per_token"] = self._nodes_seen.tolist()
                out["moe_nodes_per_token_step"] = self._nodes_step.tolist()
        if self.model.decode_plan is not None:
            out.update(self.model.decode_plan.stats())
        elif self._plan_declined is not None:   # a model the CPU fast path does not take at all (DeepSeek-V4)
            out[f"decode_declined_{self._plan_declined}"] = self.declined_decode_steps
        if self.scheduler.speculator is not None:
            out.update(self.scheduler.speculator.stats())
        if self.eplb is not None:
            m = self.eplb.metrics
            out["eplb_rebalances"] = m["rebalances"]
            out["eplb_balancedness"] = m["last"]["balancedness_after_mean"] if m["last"] else None
        return out
