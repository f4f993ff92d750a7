"""The adaptive switch for dbo.enabled = "auto": split a step only where splitting measured faster.

Steps are bucketed by phase (decode / prefill) and token count (powers of two). Per bucket: until
both choices have `min_samples` step times it alternates (explore) and picks the one with the lower
median, leaning to the unsplit step by `margin`. Then every `retry_every` steps it probes the
other choice with fresh steps (its old samples are dropped: a decode step grows slower as its
context grows, so old samples would flatter whichever choice ran long ago): the first probe step
that does not beat the chosen choice's median ends the probe; `min_samples` probe steps whose
median beats it switch. Medians, not means: on a shared machine a step is only ever slowed by
interference, and one slow sample must not flip the choice (an average did, one step in ten where
splitting costs 1.5x). Runs on rank 0; its vote is the step's decision.

    a = AutoSwitch(); split = a.decide(tokens, decode); ...run the step...; a.record(tokens, decode, split, seconds)
"""
from __future__ import annotations

import statistics
from collections import deque


class AutoSwitch:
    def __init__(self, min_samples: int = 4, retry_every: int = 50, window: int = 9, margin: float = 0.03):
        if not (1 <= min_samples <= window and retry_every >= 2 and 0 <= margin < 1):
            raise ValueError(f"AutoSwitch needs 1 <= min_samples ({min_samples}) <= window ({window}), "
                             f"retry_every ({retry_every}) >= 2 and 0 <= margin ({margin}) < 1")
        self.min_samples, self.retry_every, self.window, self.margin = min_samples, retry_every, window, margin
        self._stats: dict[tuple, dict] = {}

    @staticmethod
    def bucket(num_tokens: int, decode: bool) -> tuple:
        return ("decode" if decode else "prefill", max(num_tokens, 1).bit_length())

    def _bucket_stats(self, num_tokens: int, decode: bool) -> dict:
        return self._stats.setdefault(self.bucket(num_tokens, decode),
                                      {"n": 0, "chosen": None, "probe": False,
                                       True: deque(maxlen=self.window), False: deque(maxlen=self.window)})

    def _beats(self, split: bool, seconds: float, other_seconds: float) -> bool:
        """Whether `split`'s time beats the other choice's, leaning to the unsplit step by the margin."""
        if split:
            return seconds < (1 - self.margin) * other_seconds
        return not other_seconds < (1 - self.margin) * seconds

    def decide(self, num_tokens: int, decode: bool) -> bool:
        st = self._bucket_stats(num_tokens, decode)
        st["n"] += 1
        if st["chosen"] is None:
            for split in (False, True):
                if len(st[split]) < self.min_samples:
                    return split
            st["chosen"] = self._beats(True, statistics.median(st[True]), statistics.median(st[False]))
        c = st["chosen"]
        if not st["probe"] and st["n"] % self.retry_every == 0:
            st["probe"] = True
            st[not c].clear()
        return not c if st["probe"] else c

    def record(self, num_tokens: int, decode: bool, split: bool, seconds: float) -> None:
        st = self._bucket_stats(num_tokens, decode)
        st[split].append(seconds)
        c = st["chosen"]
        if c is None or split == c or not st["probe"]:
            return
        chosen_median = statistics.median(st[c])
        if not self._beats(split, seconds, chosen_median):
            st["probe"] = False                                   # the other choice is still worse
        elif len(st[split]) >= self.min_samples and self._beats(split, statistics.median(st[split]), chosen_median):
            st["chosen"], st["probe"] = split, False              # it kept winning: switch
