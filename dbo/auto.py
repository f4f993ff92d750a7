"""The adaptive switch for dbo.enabled = "auto": split a step only where splitting measured faster.

Steps are bucketed by phase (decode / prefill) and token count (powers of two). Per bucket it keeps
an exponential average of step time with and without the split; until both have a few samples it
alternates (explore), then picks the faster, re-trying the other every `retry_every` steps of the
bucket so a change in load or network is noticed. Runs on rank 0; its vote is the step's decision.
"""
from __future__ import annotations


class AutoSwitch:
    def __init__(self, min_samples: int = 3, retry_every: int = 50, alpha: float = 0.3):
        self.min_samples, self.retry_every, self.alpha = min_samples, retry_every, alpha
        self._stats: dict[tuple, dict] = {}

    @staticmethod
    def bucket(num_tokens: int, decode: bool) -> tuple:
        return ("decode" if decode else "prefill", max(num_tokens, 1).bit_length())

    def decide(self, num_tokens: int, decode: bool) -> bool:
        st = self._stats.setdefault(self.bucket(num_tokens, decode), {"n": 0, True: [0, 0.0], False: [0, 0.0]})
        st["n"] += 1
        for split in (False, True):
            if st[split][0] < self.min_samples:
                return split
        best = st[True][1] < st[False][1]
        if st["n"] % self.retry_every == 0:
            return not best
        return best

    def record(self, num_tokens: int, decode: bool, split: bool, seconds: float) -> None:
        st = self._stats.setdefault(self.bucket(num_tokens, decode), {"n": 0, True: [0, 0.0], False: [0, 0.0]})
        count, avg = st[split]
        st[split] = [count + 1, seconds if count == 0 else (1 - self.alpha) * avg + self.alpha * seconds]
