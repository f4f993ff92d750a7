"""A request's host-side state. Never touches the device."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose latent is in the cache
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if top is not None:
            self.logprobs.append(top)
        p = self.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = "length"
