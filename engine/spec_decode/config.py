"""SpeculativeConfig: the run config's [speculative] table, `speculative_config=` of LLM/Engine,
`--speculative-config` of the CLI (vLLM's keys)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "mtp")
# draft_dtype's values (the names engine/model/build.py's DTYPES gives them) -> the dtype's canonical name
DRAFT_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None              # None: off | "ngram" (prompt/output lookup) | "mtp" (the checkpoint's MTP layer)
    num_speculative_tokens: int = 0        # k: drafts verified per sequence per step (>= 1 when on)
    prompt_lookup_min: int | None = None   # ngram: the shortest suffix matched (vLLM: both default 5, one given: the other)
    prompt_lookup_max: int | None = None   # ngram: the longest suffix matched (tried first)
    disable_by_batch_size: int | None = None   # no drafts while more sequences than this run on the rank
    min_acceptance: float = 0.2            # a sequence whose recent drafts were accepted less than this stops
    #                                        drafting for a while (backing off, doubling), and the metrics count it
    backoff_steps: int = 16                # the first pause (steps); doubles each time up to 64x
    draft_dtype: str | None = None         # mtp: the MTP layer's weights in this dtype (DRAFT_DTYPES; None: the
    #                                        model's); a float32 model's activations and latent cache stay float32

    def __post_init__(self):
        if self.method is None:
            if self.num_speculative_tokens:
                raise ValueError(f"speculative num_speculative_tokens={self.num_speculative_tokens} needs a method "
                                 f"(one of {list(METHODS)})")
            return
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {list(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "ngram":
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative {name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif lo is not None or hi is not None:
            raise ValueError("speculative prompt_lookup_min/max are options of method \"ngram\", not "
                             f"{self.method!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative disable_by_batch_size must be an integer >= 1, got {b!r}")
        if not isinstance(self.min_acceptance, (int, float)) or not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"speculative min_acceptance must be in [0, 1], got {self.min_acceptance!r}")
        d = self.draft_dtype
        if d is not None:
            if self.method != "mtp":
                raise ValueError(f"speculative draft_dtype is an option of method \"mtp\" (the MTP layer's weights), "
                                 f"not {self.method!r}")
            if not isinstance(d, str) or d not in DRAFT_DTYPES:
                raise ValueError(f"speculative draft_dtype must be one of {sorted(DRAFT_DTYPES)}, got {d!r}")
            object.__setattr__(self, "draft_dtype", DRAFT_DTYPES[d])
        if not isinstance(self.backoff_steps, int) or isinstance(self.backoff_steps, bool) or self.backoff_steps < 1:
            raise ValueError(f"speculative backoff_steps must be an integer >= 1, got {self.backoff_steps!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def coerce(cls, v) -> "SpeculativeConfig":
        """A SpeculativeConfig, a dict of its keys, a JSON string (the CLI's) or None (off)."""
        if isinstance(v, cls):
            return v
        if v is None:
            return cls()
        if isinstance(v, str):
            import json
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not JSON ({e}): {v!r}") from None
        if not isinstance(v, dict):
            raise ValueError(f"speculative config must be a table/dict, got {type(v).__name__}")
        from dataclasses import fields
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown} (known: {sorted(known)})")
        return cls(**v)
