"""SamplingParams and request outputs, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """temperature 0 is greedy. top_k <= 0 (vLLM's -1) and top_p 1 disable those filters.
    logprobs=N: for each generated token, its logprob plus the top-N; prompt_logprobs=N: the same
    for every prompt position (None at position 0). Logprobs are of the raw model distribution."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: str = "cumulative"  # "cumulative" | "delta" (streaming) | "final_only"

    def __post_init__(self) -> None:
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            raise ValueError(f"SamplingParams.output_kind must be cumulative, delta or final_only, "
                             f"got {self.output_kind!r}")
        for name in ("n", "top_k", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"SamplingParams.{name} must be an int, got {v!r}")
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise ValueError(f"SamplingParams.{name} must be a number, got {getattr(self, name)!r}")
        if self.n != 1:
            raise ValueError(f"SamplingParams.n={self.n}: only n=1 is supported")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None:
            self.top_k = -1
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"SamplingParams.{name} must be >= 0, got {v}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "length" | "stop" | "abort"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict | None = None  # ttft_s, tpot_s, queue_s, finish_reason, token counts
