"""n > 1: one request's n independent samples, as n sequences on one DP rank that share the
prompt's KV blocks.

The front admits sample 0 alone; the other n-1 are sent once sample 0's first token is back, i.e.
once the prompt's full blocks are computed and named in the rank's prefix cache, so each of them
takes those blocks by reference (refcounted, the prefix cache's own mechanism) and computes only the
prompt's last partial block (sample 0 alone asks for prompt_logprobs, so the others still match
the cache). Without prefix caching, or for a prompt shorter than a block, they are sent at once. With a seed, sample i samples from its
own generator seeded seed + i (vLLM's rule). Sample i's request id on its rank is "{id}#{i}".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..sampling_params import SEED_RANGE, RequestOutput, SamplingParams


def sample_id(request_id: str, i: int) -> str:
    return f"{request_id}#{i}"


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample i's own params: n=1, seed + i, prompt logprobs only on sample 0 (the prompt is one)."""
    seed = params.seed
    if seed is not None:
        seed = seed + i if seed + i < SEED_RANGE[1] else seed - i
    return dataclasses.replace(params, n=1, seed=seed,
                               prompt_logprobs=params.prompt_logprobs if i == 0 else None)


@dataclass(eq=False)
class SampleGroup:
    """The front's view of one request with n samples: states[i] is sample i's RequestState;
    held: the NewRequests of samples 1..n-1 until sample 0's prompt is in the cache."""
    request_id: str
    states: list = field(default_factory=list)
    held: list = field(default_factory=list)
    latest: dict = field(default_factory=dict)   # index -> its last CompletionOutput (cumulative outputs)

    @property
    def finished(self) -> bool:
        return all(st.finished for st in self.states)

    def merge(self, out: RequestOutput, kind: str) -> RequestOutput | None:
        """A sample's RequestOutput -> the request's (None: final_only and not every sample done).
        delta: only that sample's new output; cumulative/final_only: every sample's, by index."""
        comp = out.outputs[0]
        self.latest[comp.index] = comp
        if kind == "final_only" and not self.finished:
            return None
        outputs = [comp] if kind == "delta" else [self.latest[i] for i in sorted(self.latest)]
        first = self.states[0]
        metrics = dict(out.metrics or {}, output_tokens=sum(len(st.token_ids) for st in self.states))
        return RequestOutput(request_id=self.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                             prompt_logprobs=first.prompt_logprobs, outputs=outputs, finished=self.finished,
                             metrics=metrics)
