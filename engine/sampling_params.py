"""SamplingParams and request outputs, shaped like vLLM's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from wideep.structured.params import StructuredOutputsParams

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing fp32 logits by a
# smaller one overflows them to inf, and softmax of inf is NaN.
GREEDY_BELOW = 1e-5
# torch.Generator.manual_seed accepts exactly this range; a seed outside it would fail inside a step.
SEED_RANGE = (-(1 << 63), 1 << 64)
# Stop strings are matched on the front for every new token: bounded so that a request cannot make
# the front's per-token work (or its hold-back of streamed text) unbounded. vLLM sets no limit;
# these are far above what clients send (lm-eval sends a handful, OpenAI allows 4).
MAX_STOP_STRINGS = 128
MAX_STOP_LEN = 512
# n samples of one prompt are n sequences on one rank: bounded like a batch a client may ask for.
MAX_N = 128


@dataclass
class SamplingParams:
    """temperature 0 (anything below 1e-5) is greedy. top_k -1 or 0 (both as in vLLM) and top_p 1
    disable those filters; top_k 0 is stored as -1. logprobs=N: for each generated token, its logprob
    plus the top-N; prompt_logprobs=N: the same for every prompt position (None at position 0).
    Logprobs are of the raw model distribution. N is capped by the engine (max_logprobs, default
    20, and the vocabulary) when the request is added. seed: in [-2**63, 2**64), torch's range.

    Logits processing, as vLLM defines it (engine/sampling/logits_process.py applies it): min_tokens:
    EOS and stop_token_ids are masked until that many tokens are out (stop strings, matched on the
    front's text, must not end a request before then either: vLLM's rule); logit_bias {token id: bias}
    (clamped to [-100, 100], ids checked against the vocabulary at admission) is added to the logits;
    repetition_penalty (> 0, 1 off) divides the positive and multiplies the negative logits of every
    token in the prompt or the output; frequency_penalty and presence_penalty (in [-2, 2], 0 off)
    subtract penalty * count and penalty * (count > 0) over the output tokens; min_p (in [0, 1], 0
    off) drops, after temperature, the tokens whose probability is below min_p * the top one's.

    n: independent samples of the prompt (sample i seeded seed + i). stop: strings matched on the
    detokenized output (cut before the match, or after it with include_stop_str_in_output);
    CompletionOutput.stop_reason names the string or stop token that ended it; the stop token (EOS
    or one of stop_token_ids) that ends a request is not in its text unless include_stop_str_in_output.
    skip_special_tokens: the text leaves the tokenizer's special tokens out (vLLM's default, True);
    the chat endpoint turns it off only when its tool-call parser's markup is special tokens.

    structured_outputs: a StructuredOutputsParams (or a dict of its fields: json / regex / choice /
    grammar / json_object), vLLM's field: the output is constrained to match it (structured/); EOS is
    allowed only where the grammar may end, and the request finishes ("stop") when the grammar does."""

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
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # -- stop strings (n is the first field, as in vLLM) --
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            raise ValueError(f"SamplingParams.output_kind must be cumulative, delta or final_only, "
                             f"got {self.output_kind!r}")
        for name in ("n", "top_k", "max_tokens", "logprobs", "prompt_logprobs", "seed", "min_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"SamplingParams.{name} must be an int, got {v!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"SamplingParams.{name} must be a number, got {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be finite, got {v}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"SamplingParams.seed must be in [-2**63, 2**64), got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"SamplingParams.{name} must be >= 0, got {v}")
        stop = self.stop_token_ids
        if stop is not None and (not isinstance(stop, (list, tuple))
                                 or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints, got {stop!r}")
        self.stop_token_ids = list(stop or [])
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"SamplingParams.skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        self._check_logits_processing()
        self._check_stop_and_n()
        self._check_structured()
        self._processed = (self.penalised or self.logit_bias is not None or self.min_tokens > 0
                           or self.min_p > 0 or self.structured_outputs is not None)

    def _check_structured(self) -> None:
        try:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"SamplingParams.{e}" if str(e).startswith("structured_outputs") else
                             f"SamplingParams.structured_outputs: {e}") from None
        if self.structured_outputs is not None and self.min_tokens > 0:
            # min_tokens masks EOS where the grammar may allow nothing else: no token would remain
            raise ValueError("SamplingParams.min_tokens cannot be combined with structured_outputs "
                             "(the grammar decides where the output ends)")

    def _check_logits_processing(self) -> None:
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {v}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {bias!r}")
        clean = {}
        for t, v in bias.items():
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"SamplingParams.logit_bias keys must be int token ids, got {t!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SamplingParams.logit_bias[{t}] must be a finite number, got {v!r}")
            clean[t] = min(100.0, max(-100.0, float(v)))   # vLLM's OpenAI layer clamps the same way
        self.logit_bias = clean or None

    @property
    def penalised(self) -> bool:
        """Needs the per-sequence token counts (engine/sampling/logits_process.py)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def processed(self) -> bool:
        """Any logits processing beyond temperature / top-k / top-p (min_tokens is checked per step).
        Asked for every sampling row every step: computed once, when the params are checked."""
        return self._processed

    def _check_stop_and_n(self) -> None:
        """n in [1, MAX_N]; stop: a string or a list of non-empty strings (stored as a list)."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"SamplingParams.n must be in [1, {MAX_N}], got {self.n}")
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}"[:300])
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in stop:
            if not s:
                raise ValueError("SamplingParams.stop contains an empty string")
            if len(s) > MAX_STOP_LEN:
                raise ValueError(f"SamplingParams.stop has a string of {len(s)} characters; "
                                 f"at most {MAX_STOP_LEN} are allowed")
        self.stop = list(stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"SamplingParams.include_stop_str_in_output must be true or false, "
                             f"got {self.include_stop_str_in_output!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    stop_reason: int | str | None = None  # finish_reason "stop": the matched stop string or stop token id


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict | None = None  # ttft_s, tpot_s, queue_s, finish_reason, token counts
