"""Offline API shaped like vLLM's: `LLM(model, **options).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import os
from typing import Sequence as Seq

import torch

from attention_mla.kv_cache import BlockAllocator, LatentKVPool

from .config import ModelConfig
from .loader import CheckpointReader, load_weights
from .model import DeepseekModel
from .runner import ModelRunner
from .sampling_params import CompletionOutput, RequestOutput, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: {sorted(DTYPES)})")
    return DTYPES[dtype]


def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               progress: bool = True) -> DeepseekModel:
    cfg = ModelConfig.from_dir(model_dir)
    model = DeepseekModel(cfg, device=device, dtype=dtype)
    load_weights(CheckpointReader(model_dir), model.checkpoint_targets(),
                 num_hidden_layers=cfg.num_hidden_layers, progress=progress)
    return model.eval()


def _load_tokenizer(model_dir: str):
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


class LLM:
    """Single-process engine over one checkpoint directory.

    Options: dtype, device, max_model_len (default max_position_embeddings), block_size,
    kv_cache_blocks (default: enough for max_num_seqs sequences of max_model_len, capped by
    kv_cache_memory bytes), max_num_seqs, max_num_batched_tokens, seed.
    """

    def __init__(self, model: str, dtype: str | torch.dtype = "float32", device: str = "cpu", *,
                 max_model_len: int | None = None, block_size: int = 64, kv_cache_blocks: int | None = None,
                 kv_cache_memory: int = 1 << 30, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 seed: int = 0, progress: bool = True):
        self.model_dir = model
        self.model = load_model(model, parse_dtype(dtype), device, progress)
        cfg = self.config = self.model.cfg
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
        self.tokenizer = _load_tokenizer(model)
        self._ids = itertools.count()
        self._generator = torch.Generator(device=device).manual_seed(seed)

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
        """prompts: a string, a list of token ids, or a list of either. Returns outputs in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        # validate everything before accepting anything
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, params)]
        for s in seqs:
            self.scheduler.add(s)
        while self.scheduler.has_work():
            batch = self.scheduler.schedule()
            if not batch.seqs:
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
            self.runner.execute(batch)
            for s in batch.seqs:
                if s.finished:
                    self.scheduler.finish(s)
        return [self._output(s) for s in seqs]
