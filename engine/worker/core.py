"""One rank's engine parts, built from one EngineConfig in named steps, and request validation and admission.

    EngineCore(cfg)   check (the model family's refusals) -> connect -> load -> size_kv -> allocate -> wire -> warm_up
    load              the model (and the MTP drafter's layer) through its family (engine/model/family.py)
    size_kv           the context length the cache must hold
    allocate          the KV cache (the family's streams), its tiers, the block manager, the scheduler (with the
                      speculator and its lookahead), the MTP drafter
    wire              what depends on the parallel context: the MoE dispatcher, DBO's overlap, the step sync, EPLB,
                      and the runner that holds them; recovery after a lost rank runs it again over the survivors
    warm_up           the tokenizer, the sampling generator, the start-up heap frozen

The step loop (engine/worker/rank_loop.py) drives these; the front (engine/front/front.py) validates with them. Nothing
here knows a model family: the family object answers.
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

from wideep.kvstore.events import HeldLog
from wideep.parallel.context import ParallelContext

from ..engine_config import EngineConfig
from ..model.build import make_model_dispatcher, parse_dtype
from ..model.families import family_of
from ..model.model_config import ModelConfig
from ..sampling_params import SamplingParams
from ..sched.scheduler import Scheduler
from ..sched.sequence import Sequence
from .messages import NewRequest
from .runner import ModelRunner
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


def _is_decode(num_tokens: list[int]) -> bool:
    """A step of decodes only (one token per sequence): the DBO auto switch times these apart."""
    return bool(num_tokens) and all(n == 1 for n in num_tokens)


class EngineCore:
    def __init__(self, cfg: EngineConfig, ctx: ParallelContext | None = None, progress: bool = True,
                 wire: bool = True):
        """wire=False: a rank joining a running deployment (engine/worker/join.py) loads and allocates before its
        groups exist; the resize wires it (rewire) together with the running ranks."""
        self.cfg = cfg
        mcfg = self.config = ModelConfig.from_dir(cfg.model)
        self.family = family_of(mcfg)
        self.family.check(cfg)   # before connecting: the same error on every rank
        self.ctx = ctx = ctx if ctx is not None else connect(cfg, mcfg)
        if not ctx.is_single:
            from wideep.parallel import check_agreement, fingerprint
            check_agreement(ctx, fingerprint([asdict(mcfg), cfg.to_dict()]), "model config / engine config")
        self.model_dir = cfg.model
        self.device = cfg.device or str(ctx.device)
        pcfg = cfg.parallel
        from wideep.parallel.comm_stream import SimulatedNetwork
        self.dispatch_options = dict(low_latency_max_tokens=pcfg.deepep_low_latency_max_tokens,
                                     torch_low_latency_max_tokens=pcfg.torch_low_latency_max_tokens,
                                     link=SimulatedNetwork.from_config(pcfg))
        self.load(progress)
        self.size_kv()
        self.allocate()
        if wire:
            self.wire()
        else:
            self.runner = self.sync = self.eplb = None
        self.warm_up()

    # -- the named steps ---------------------------------------------------------------------------------
    def load(self, progress: bool) -> None:
        """The model on this rank (only its experts), and the MTP drafter's layer when speculative decoding asks."""
        self.loaded = self.family.load(self.cfg, self.ctx, self.device, progress and self.ctx.rank == 0)
        self.model = self.loaded.model

    def size_kv(self) -> None:
        """The context the cache holds per sequence (max_model_len; at most the model's positions)."""
        mcfg = self.config
        self.max_model_len = self.cfg.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) > max_position_embeddings "
                             f"({mcfg.max_position_embeddings})")

    def allocate(self) -> None:
        """The KV cache and its tiers, the block manager, the scheduler with the speculator, the MTP drafter; DBO's
        auto switch (its timings outlive a re-wiring)."""
        cfg = self.cfg
        self.kv = self.family.kv_cache(cfg, self.loaded, self.max_model_len)
        log = HeldLog(enabled=cfg.enable_prefix_caching and cfg.kv_cache.routing == "kv_aware")
        self.store = self.family.kv_store(cfg, self.kv, log, self.ctx.dp_rank) if cfg.kv_cache.tiers else None
        self.blocks = self.family.block_manager(cfg, self.kv, self.store, log, whole_chunks=self._dbo_on())
        spec = cfg.speculative
        speculator, self.drafter, lookahead = None, None, 0
        if spec.enabled:
            from ..spec_decode.speculator import Speculator
            speculator = Speculator(spec)
            if spec.method == "mtp":
                self.drafter = self.family.drafter(self.loaded, self.kv, spec.num_speculative_tokens)
                lookahead = spec.num_speculative_tokens - 1
        mixed = cfg.max_mixed_step_tokens
        if mixed is None:   # the step the model's fused path takes, where it has one
            plan = self.model.decode_plan
            mixed = plan.step_tokens() if plan is not None else None
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, speculator=speculator,
                                   lookahead=lookahead, mixed_step_tokens=mixed or None)
        self.auto = None
        if self._dbo_on() and cfg.dbo.enabled == "auto":
            from wideep.dbo.auto import AutoSwitch
            self.auto = AutoSwitch()

    def wire(self) -> None:
        """What depends on the parallel context, built over self.ctx: the MoE dispatcher, DBO's microbatch
        dispatchers, the step sync, EPLB, and the runner that holds them. At start-up, and again by recovery after a
        lost rank (engine/worker/recovery.py) once the survivors re-formed and the experts were re-laid."""
        cfg, ctx, model = self.cfg, self.ctx, self.model
        model.use_dispatcher(make_model_dispatcher(self.config, ctx, model.placement, self.device,
                                                   cfg.parallel.dispatch_backend, model.dtype, self.dispatch_options))
        overlap = None
        if self._dbo_on():
            from wideep.dbo.overlap import Overlap
            overlap = Overlap(model, ctx)  # collective: every rank builds its groups
        self.eplb = None
        if cfg.eplb.enabled and self.config.moe is not None:
            from wideep.eplb.controller import EplbController
            self.eplb = EplbController(model, ctx, cfg.eplb)
        d = model.dispatcher
        self.sync = StepSync(ctx, d.low_latency_max_tokens if d is not None else 0)
        self.runner = ModelRunner(model, self.kv, overlap, self.drafter, self.scheduler.speculator,
                                  grammars=lambda: self.grammars)
        self._nodes_seen = self._nodes_step = None   # routing histograms (cumulative, last step) of these dispatchers

    def unwire(self) -> None:
        """Drop everything wire built (their references keep the old process groups alive): before re-forming
        (after a loss, or a resize on request)."""
        self.model.use_dispatcher(None)
        if self.runner.overlap is not None:
            self.runner.overlap.close()
        if self.eplb is not None:
            self.eplb.detach()
        self.runner = self.sync = self.eplb = None

    def rewire(self, ctx: ParallelContext) -> None:
        """wire over a re-formed context (recovery after a lost rank, a resize): the new groups and numbering."""
        self.ctx = ctx
        self.wire()

    def warm_up(self) -> None:
        """The tokenizer, the engine's sampling generator, the grammar compiler's slot; the start-up heap frozen."""
        self.split_steps = 0
        self._plan_declined = getattr(self.model, "decode_plan_declined", None)   # why no CPU decode plan (V4)
        self.declined_decode_steps = 0
        self.tokenizer = _load_tokenizer(self.cfg.model)
        self._generator = torch.Generator(device=self.device).manual_seed(self.cfg.seed + self.ctx.rank)
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
               "kv_device_cached_bytes": sum(n * self.kv.block_bytes()[s] for s, n in b.cached_per_stream().items()),
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
        if self.model.backends.get("kernels") == "cpu":   # where this rank's C kernels run (cpu/tune.py)
            from wideep.cpu import tune
            out.update({f"cpu_kernel_limit_{k}": v for k, v in tune.choices()["limits"].items()})
        if self._plan_declined is not None:   # a model the CPU fast path does not take at all (DeepSeek-V4's reference)
            out[f"decode_declined_{self._plan_declined}"] = self.declined_decode_steps
        for path, n in getattr(self.model, "step_paths", {}).items():   # DeepSeek-V4's batched decode steps
            out[f"decode_steps_{path}"] = n
        if self.scheduler.speculator is not None:
            out.update(self.scheduler.speculator.stats())
        if self.eplb is not None:
            m = self.eplb.metrics
            out["eplb_rebalances"] = m["rebalances"]
            out["eplb_balancedness"] = m["last"]["balancedness_after_mean"] if m["last"] else None
        return out
