"""One rank's engine parts: parallel context, model, paged latent cache, block manager, scheduler,
runner, tokenizer; request validation and output building. Engine (engine.py) drives these."""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Sequence as Seq

import torch

from attention_mla.kv_cache import LatentKVPool
from parallel.context import ParallelContext

from .block_manager import BlockManager
from .build import load_model, parse_dtype
from .config import ModelConfig
from .runner import ModelRunner
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .spmd import StepSync


def _load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def resolve_context(cfg: ModelConfig, parallel, dp_size, ep_size, dispatch_backend, ctx, eplb_cfg=None):
    """-> (ParallelContext, ParallelConfig). Sizes not given follow the launcher's world size, so one
    script or config file serves 1 and N ranks; they are validated before connecting."""
    from parallel import ParallelConfig, bootstrap, launch_world_size
    par = parallel.to_dict() if isinstance(parallel, ParallelConfig) else dict(parallel or {})
    par.update({k: v for k, v in (("dp_size", dp_size), ("ep_size", ep_size),
                                  ("dispatch_backend", dispatch_backend)) if v is not None})
    if ctx is not None:
        par.setdefault("dp_size", ctx.dp_size)
        par.setdefault("ep_size", ctx.ep_size)
        return ctx, ParallelConfig.from_dict(par)
    world = launch_world_size()
    par.setdefault("dp_size", world)
    par.setdefault("ep_size", world)
    if eplb_cfg is not None:  # EPLB's redundant slots count in the divisibility check before connecting
        par["num_redundant_experts"] = eplb_cfg.redundant_with(par.get("num_redundant_experts", 0))
    pcfg = ParallelConfig.from_dict(par)
    pcfg.validate(world, cfg.moe.n_routed_experts if cfg.moe else None)  # the same error on every rank
    if world > 1:
        return bootstrap(pcfg), pcfg
    return ParallelContext.single("cuda" if torch.cuda.is_available() else "cpu"), pcfg  # CUDA when present


class EngineCore:
    """Options: see Engine. eplb: an eplb.config.EplbConfig or dict ([eplb] keys); dbo: a
    dbo.overlap.DboConfig, dict ([dbo] keys), True/False or "auto"."""

    def __init__(self, model: str, dtype: str | torch.dtype = "float32", device: str | None = None, *,
                 max_model_len: int | None = None, block_size: int = 64, kv_cache_blocks: int | None = None,
                 kv_cache_memory: int = 1 << 30, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, seed: int = 0, progress: bool = True,
                 dp_size: int | None = None, ep_size: int | None = None, dispatch_backend: str | None = None,
                 parallel=None, ctx: ParallelContext | None = None, dbo=None, eplb=None,
                 experts_backend: str = "auto", attention_backend: str = "auto"):
        from dbo.overlap import DboConfig
        from eplb.config import EplbConfig
        self.dbo = DboConfig.coerce(dbo)
        self.eplb_cfg = EplbConfig.coerce(eplb)
        cfg = ModelConfig.from_dir(model)
        self.ctx, self.pcfg = resolve_context(cfg, parallel, dp_size, ep_size, dispatch_backend, ctx, self.eplb_cfg)
        if not self.ctx.is_single:
            from parallel import check_agreement, fingerprint
            options = dict(dtype=str(dtype), max_model_len=max_model_len, block_size=block_size, dbo=asdict(self.dbo),
                           eplb=self.eplb_cfg.to_dict(),
                           kv_cache_blocks=kv_cache_blocks, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, seed=seed,
                           enable_prefix_caching=enable_prefix_caching, experts_backend=experts_backend,
                           attention_backend=attention_backend)
            check_agreement(self.ctx, fingerprint([asdict(cfg), self.pcfg.to_dict(), options]),
                            "model config / engine options")
        device = device or str(self.ctx.device)
        self.model_dir, self.config = model, cfg
        link = None
        if self.pcfg.simulated_latency_us or self.pcfg.simulated_gbps:
            from parallel.comm_stream import SimulatedLink
            link = SimulatedLink(self.pcfg.simulated_latency_us, self.pcfg.simulated_gbps)
        self.model = load_model(model, parse_dtype(dtype), device, progress and self.ctx.rank == 0, self.ctx,
                                self.pcfg.dispatch_backend, cfg, num_redundant_experts=self.pcfg.num_redundant_experts,
                                eplb=self.eplb_cfg, experts_backend=experts_backend,
                                attention_backend=attention_backend,
                                dispatch_options=dict(
                                    low_latency_max_tokens=self.pcfg.deepep_low_latency_max_tokens,
                                    torch_low_latency_max_tokens=self.pcfg.torch_low_latency_max_tokens, link=link))
        self.eplb = None
        if self.eplb_cfg.enabled and cfg.moe is not None:
            from eplb.controller import EplbController
            self.eplb = EplbController(self.model, self.ctx, self.eplb_cfg)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) > max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        dt = self.model.dtype
        if kv_cache_blocks is None:
            per_block = LatentKVPool.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.mla.latent_dim, dt)
            want = max_num_seqs * -(-self.max_model_len // block_size)
            kv_cache_blocks = max(1, min(want, kv_cache_memory // per_block))
        self.kv = LatentKVPool(cfg.num_hidden_layers, kv_cache_blocks, block_size, cfg.mla.latent_dim, dt, device)
        self.blocks = BlockManager(kv_cache_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        overlap, self.auto = None, None
        if self.dbo.enabled and cfg.moe is not None:
            from dbo.overlap import Overlap
            overlap = Overlap(self.model, self.ctx)  # collective: every rank builds its groups
            if self.dbo.enabled == "auto":
                from dbo.auto import AutoSwitch
                self.auto = AutoSwitch()
        self.runner = ModelRunner(self.model, self.kv, overlap)
        self.split_steps = 0
        d = self.model.dispatcher
        self.sync = StepSync(self.ctx, d.low_latency_max_tokens if d is not None else 0)
        self.tokenizer = _load_tokenizer(model)
        self._generator = torch.Generator(device=device).manual_seed(seed + self.ctx.rank)

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
        need = self.blocks.blocks_for(len(ids) + max_tokens - 1)
        if need > self.blocks.allocator.num_blocks:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks; "
                             f"the cache has {self.blocks.allocator.num_blocks}")
        return max_tokens

    def make_sequence(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                      max_tokens: int) -> Sequence:
        gen = None
        if not params.greedy:
            gen = (torch.Generator(device=self.model.device).manual_seed(params.seed)
                   if params.seed is not None else self._generator)
        return Sequence(request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
                        max_tokens=max_tokens, eos_token_ids=self.config.eos_token_ids, generator=gen,
                        logprobs=[] if params.logprobs is not None else None)

    def output(self, s: Sequence, delta: bool = False) -> RequestOutput:
        """Cumulative (vLLM's default) or only the tokens not reported before (streaming)."""
        start = s.num_sent if delta else 0
        toks = list(s.output_token_ids[start:])
        s.num_sent = len(s.output_token_ids)
        text = self._text(s, delta)
        lps = s.logprobs[start:] if s.logprobs is not None else None
        comp = CompletionOutput(index=0, text=text, token_ids=toks, cumulative_logprob=s.cumulative_logprob,
                                logprobs=lps, finish_reason=s.finish_reason)
        return RequestOutput(request_id=s.request_id, prompt=s.prompt, prompt_token_ids=s.prompt_token_ids,
                             prompt_logprobs=s.prompt_logprobs, outputs=[comp], finished=s.finished,
                             metrics=s.metrics())

    def _text(self, s: Sequence, delta: bool) -> str:
        """The output text (or, for delta outputs, what was not reported yet), decoded incrementally:
        only a window of the last few tokens is decoded per step, and the new text is the window's
        text minus the text of its already-decoded part (so tokenizers that treat a sequence's start
        specially still concatenate). A character whose UTF-8 bytes span several tokens decodes to
        U+FFFD until its last token arrives: it is held back until then (or until the request
        finishes)."""
        if self.tokenizer is None:
            return ""
        ids = s.output_token_ids
        if len(ids) > s.detok_read:
            seen = self.tokenizer.decode(ids[s.detok_prefix:s.detok_read])
            window = self.tokenizer.decode(ids[s.detok_prefix:])
            if len(window) > len(seen) and (s.finished or not window.endswith("\ufffd")):
                s.text += window[len(seen):]
                s.detok_prefix, s.detok_read = s.detok_read, len(ids)
        if not delta:
            return s.text
        new, s.text_sent = s.text[s.text_sent:], len(s.text)
        return new

    def split_votes(self, num_tokens: list[int]) -> tuple[bool, bool]:
        """DBO: (this rank may split its step, this rank votes to split). Only rank 0's vote counts."""
        if self.runner.overlap is None:
            return False, False
        from dbo.split import can_split
        ok = can_split(num_tokens, self.dbo.split) if num_tokens else True  # an idle rank never blocks a split
        if self.auto is None:
            return ok, True
        decode = bool(num_tokens) and all(n == 1 for n in num_tokens)
        return ok, self.auto.decide(sum(num_tokens), decode)

    def _dispatchers(self) -> list:
        """The model's dispatcher and DBO's microbatch dispatchers, each once (DeepEP's is shared)."""
        overlap = self.runner.overlap.dispatchers if self.runner.overlap is not None else []
        return list({id(d): d for d in [self.model.dispatcher, *overlap] if d is not None}.values())

    def after_step(self, num_tokens: list[int], split: bool, seconds: float) -> None:
        """Every rank, after every step that ran (dummy steps included): EPLB's step counter and
        load window (a rebalance, when due, is collective), and the DBO auto switch's timings."""
        self.split_steps += split
        if self.eplb is not None:
            self.eplb.after_step(sum(num_tokens))
        if self.auto is not None:
            decode = bool(num_tokens) and all(n == 1 for n in num_tokens)
            self.auto.record(sum(num_tokens), decode, split, seconds)

    def stats(self) -> dict:
        """This rank's scheduler and cache state, plus cumulative MoE all-to-all bytes (this rank's
        sends, DBO's microbatch dispatchers included), DBO split steps and EPLB rebalances."""
        b = self.blocks
        out = {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
               "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free, "kv_blocks_total": b.allocator.num_blocks,
               "prefix_queried_tokens": b.queried_tokens, "prefix_hit_tokens": b.hit_tokens,
               "preemptions": self.scheduler.num_preemptions, "dbo_split_steps": self.split_steps}
        disp = self._dispatchers()
        if disp:
            out["dispatch_bytes_remote"] = sum(d.stats.dispatch_bytes_remote + d.stats.combine_bytes_remote
                                               for d in disp)
        if self.eplb is not None:
            m = self.eplb.metrics
            out["eplb_rebalances"] = m["rebalances"]
            out["eplb_balancedness"] = m["last"]["balancedness_after_mean"] if m["last"] else None
        return out
