"""The adaptive switch for dbo.enabled = "auto": split a step only where splitting measured clearly faster.

Steps are bucketed by phase (decode / prefill) and token count (powers of two). A bucket runs
unsplit until a trial says otherwise. A trial interleaves the two choices step by step (the
bucket's current choice, the other, the current, ...) and judges each step of the other choice
against the step just before it: a pair of adjacent steps shares the load on the machine and the
context length, which steps taken in blocks or medians kept across many steps do not (interference
on shared cores comes and goes over a few steps; a block of unsplit steps caught in it once made
splitting look 2x faster). Per pair the ratio is split ÷ unsplit; the trial ends
  - after 2 pairs when every pair split clearly slower (ratio >= 1 + `clear`): unsplit,
    or, for a bucket that splits, every pair clearly faster (<= 1 - `clear`): split;
  - else after `min_pairs` pairs: split only when the median ratio <= 1 - `margin` and, to start
    splitting (not to keep on), 4 pairs in 5 split faster: cheap to decline, dear to split wrongly.
Then the bucket keeps its choice for `interval` steps and runs a fresh trial (conditions change).
The interval is `retry_every` after a trial that chose to split where the bucket did not; else it
starts at `retry_every`, doubles each time a trial confirms the choice (up to `max_interval`), and
is at least what keeps the next trial's cost — the time its other-choice steps will take beyond
their pair's step, in steps, by this trial's pairs — within `budget` of the steps between trials:
a decode step that splits 1.75x slower costs ~1.5 steps per trial, so it is re-tried every >= 150 steps.
A new bucket starts unsplit without a trial (its first after `retry_every` steps) when a bucket of the
same phase with more tokens found splitting slower: the split's gain (work per microbatch to hide
the communication behind) shrinks with the tokens, its cost (weights read twice, per-operation
overhead) does not.
Runs on every rank; rank 0's vote is the step's decision (the step sync carries it).

    a = AutoSwitch(); split = a.decide(tokens, decode); ...run the step...; a.record(tokens, decode, split, seconds)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    split: bool = False                 # the choice outside trials
    trial: bool = True                  # comparing the two choices now
    ratios: list = field(default_factory=list)    # split ÷ unsplit, one per pair of this trial
    prev: tuple | None = None           # (split, seconds) of the bucket's last recorded step in this trial
    steps: int = 0                      # decisions taken
    next_trial: int = 0                 # `steps` at which the next trial starts
    interval: int = 0                   # steps between trials now
    trials: int = 0                     # trials finished


class AutoSwitch:
    def __init__(self, min_pairs: int = 5, margin: float = 0.05, clear: float = 0.15, retry_every: int = 50,
                 max_interval: int = 1000, budget: float = 0.01):
        if not (2 <= min_pairs and 0 <= margin < clear < 1 and 2 <= retry_every <= max_interval and 0 < budget < 1):
            raise ValueError(f"AutoSwitch needs min_pairs ({min_pairs}) >= 2, 0 <= margin ({margin}) < clear "
                             f"({clear}) < 1, 2 <= retry_every ({retry_every}) <= max_interval ({max_interval}) "
                             f"and 0 < budget ({budget}) < 1")
        self.min_pairs, self.margin, self.clear = min_pairs, margin, clear
        self.retry_every, self.max_interval, self.budget = retry_every, max_interval, budget
        self._buckets: dict[tuple, _Bucket] = {}

    @property
    def explore_steps(self) -> int:
        """The most steps a bucket's first trial takes (both choices, min_pairs pairs)."""
        return 2 * self.min_pairs

    @staticmethod
    def bucket(num_tokens: int, decode: bool) -> tuple:
        return ("decode" if decode else "prefill", max(num_tokens, 1).bit_length())

    def _bucket(self, num_tokens: int, decode: bool) -> _Bucket:
        key = self.bucket(num_tokens, decode)
        b = self._buckets.get(key)
        if b is None:
            larger_unsplit = any(k[0] == key[0] and k[1] > key[1] and o.trials and not o.split
                                 for k, o in self._buckets.items())
            b = self._buckets[key] = (_Bucket(trial=False, next_trial=self.retry_every, interval=self.retry_every)
                                      if larger_unsplit else _Bucket())
        return b

    def decide(self, num_tokens: int, decode: bool) -> bool:
        b = self._bucket(num_tokens, decode)
        b.steps += 1
        if not b.trial and b.steps >= b.next_trial:
            b.trial, b.ratios, b.prev = True, [], None   # its first step: a fresh pair partner
        if b.trial and b.prev is not None and b.prev[0] == b.split:
            return not b.split
        return b.split

    def record(self, num_tokens: int, decode: bool, split: bool, seconds: float) -> None:
        """The step's choice as it ran (a rank's veto may have kept it whole) and its seconds."""
        b = self._bucket(num_tokens, decode)
        if not b.trial:
            return
        if b.prev is not None and b.prev[0] == b.split and split != b.split:
            mine = b.prev[1]
            b.ratios.append(seconds / mine if split else mine / seconds)
            self._judge(b)
        b.prev = (split, seconds) if b.trial else None

    def _judge(self, b: _Bucket) -> None:
        r = b.ratios
        if len(r) >= 2 and min(r) >= 1 + self.clear:
            self._end(b, False)
        elif b.split and len(r) >= 2 and max(r) <= 1 - self.clear:
            self._end(b, True)
        elif len(r) >= self.min_pairs:
            faster = statistics.median(r) <= 1 - self.margin
            self._end(b, faster and (b.split or sum(x < 1 for x in r) >= 0.8 * len(r)))

    def _end(self, b: _Bucket, split: bool) -> None:
        confirmed = b.trials > 0 and split == b.split
        if split and not confirmed:    # a new split: the least certain choice, checked again soon
            b.interval = self.retry_every
        else:
            interval = min(2 * b.interval, self.max_interval) if confirmed else self.retry_every
            # what the next trial's steps of the other choice will cost, in steps, by this trial's pairs
            cost = sum(max(0.0, (x if not split else 1 / x) - 1) for x in b.ratios)
            b.interval = min(max(interval, math.ceil(cost / self.budget)), self.max_interval)
        b.split, b.trial, b.trials, b.next_trial = split, False, b.trials + 1, b.steps + b.interval
