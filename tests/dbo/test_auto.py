"""The DBO auto switch (dbo/auto.py) on simulated step times with one-sided noise (interference
only slows a step, now and then by a lot): it settles on the faster choice, splits a slower-to-split
bucket only on its explore and retry steps, also while every step grows slower (decode context),
notices a change, and keeps buckets apart."""
from __future__ import annotations

import random

import pytest

from dbo.auto import AutoSwitch


def _run(auto: AutoSwitch, steps: int, cost, seed: int, tokens: int = 16, decode: bool = True) -> list[bool]:
    """cost(split) or cost(split, step) -> the step's true seconds; noise: +0-10 % always, +50-150 %
    on 10 % of steps."""
    rng = random.Random(seed)
    splits = []
    for i in range(steps):
        split = auto.decide(tokens, decode)
        t = (cost(split, i) if cost.__code__.co_argcount == 2 else cost(split)) * (1 + 0.1 * rng.random())
        if rng.random() < 0.1:
            t *= 1.5 + rng.random()
        auto.record(tokens, decode, split, t)
        splits.append(split)
    return splits


@pytest.mark.parametrize("seed", range(5))
def test_slower_split_is_only_explored_and_retried(seed):
    auto = AutoSwitch()
    splits = _run(auto, 500, lambda split: 0.075 if split else 0.05, seed)
    later = splits[auto.min_samples * 2:]
    assert sum(later) <= len(later) // auto.retry_every + 2, sum(later)   # the retries, a wrong flip or two at most


@pytest.mark.parametrize("seed", range(5))
def test_faster_split_is_kept(seed):
    auto = AutoSwitch()
    splits = _run(auto, 300, lambda split: 0.6 if split else 0.9, seed, tokens=1024, decode=False)
    later = splits[auto.min_samples * 2:]
    assert len(later) - sum(later) <= len(later) // auto.retry_every + 2


@pytest.mark.parametrize("seed", range(3))
def test_drift_does_not_flatter_old_samples(seed):
    """Decode steps grow slower as the context grows (here 2x over the run); splitting stays 1.3x
    slower throughout. Split samples from long ago must not beat today's unsplit steps."""
    auto = AutoSwitch()
    splits = _run(auto, 600, lambda split, i: (0.05 + 0.05 * i / 600) * (1.3 if split else 1.0), seed)
    later = splits[auto.min_samples * 2:]
    assert sum(later) <= len(later) // auto.retry_every + 2, sum(later)


def test_notices_a_change_and_keeps_buckets_apart():
    auto = AutoSwitch()
    slow_split = {"v": True}
    _run(auto, 100, lambda split: (0.075 if split else 0.05) if slow_split["v"] else (0.03 if split else 0.05), 1)
    slow_split["v"] = False    # the network got slower: splitting now wins
    splits = _run(auto, 300, lambda split: 0.03 if split else 0.05, 2)
    assert all(splits[-100:][i] for i in range(100) if (i + 1) % auto.retry_every), "did not switch to split"
    # a prefill bucket has its own samples: it starts exploring from scratch
    assert auto.decide(1024, False) is False and auto.bucket(1024, False) != auto.bucket(16, True)


def test_bad_settings():
    with pytest.raises(ValueError, match=r"min_samples \(5\) <= window \(3\)"):
        AutoSwitch(min_samples=5, window=3)
