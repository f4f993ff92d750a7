"""The adaptive switch for dbo.enabled = "auto": split a step only where splitting measured faster.

Steps are bucketed by phase (decode / prefill) and token count (powers of two). Per bucket it keeps
the last `window` step times with and without the split; until both have `min_samples` it
alternates (explore), then splits only when the split's median is below the unsplit median by more
than `margin`, re-trying the other choice every `retry_every` steps of the bucket, and again at
once while those retries beat the chosen median, so a change in load or network is noticed. Medians, not means: on a shared machine a step is only ever slowed by
interference, and one slow sample must not flip the choice (a mean did, about one step in ten,
where splitting costs 1.5x). The margin leans to the unsplit step when the two are within noise.
Runs on rank 0; its vote is the step's decision.

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
                                      {"n": 0, "best": None, "probe": False,
                                       True: deque(maxlen=self.window), False: deque(maxlen=self.window)})

    def _split_wins(self, split_s: float, off_s: float) -> bool:
        return split_s < (1 - self.margin) * off_s

    def decide(self, num_tokens: int, decode: bool) -> bool:
        st = self._bucket_stats(num_tokens, decode)
        st["n"] += 1
        for split in (False, True):
            if len(st[split]) < self.min_samples:
                return split
        best = self._split_wins(statistics.median(st[True]), statistics.median(st[False]))
        if st["best"] is not None and best != st["best"]:
            st["probe"] = True   # a flip: check the old choice at once (its window may hold a burst of noise)
        st["best"] = best
        if st["probe"] or st["n"] % self.retry_every == 0:
            return not best
        return best

    def record(self, num_tokens: int, decode: bool, split: bool, seconds: float) -> None:
        st = self._bucket_stats(num_tokens, decode)
        best = st["best"]
        if best is not None and split != best:
            # A retry of the other choice. While its steps beat the chosen median, retry it again at
            # once: a changed network flips the choice in a few steps, not a few retry periods.
            chosen = statistics.median(st[best])
            st["probe"] = self._split_wins(seconds, chosen) if split else not self._split_wins(chosen, seconds)
        st[split].append(seconds)
