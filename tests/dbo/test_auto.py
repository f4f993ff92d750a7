"""The DBO auto switch (dbo/auto.py) on simulated step times with one-sided noise (interference
only slows a step, now and then by a lot, and on a shared machine for several steps in a row): it
keeps a slower-to-split bucket whole except for rare, amortised trials, is not fooled by load that
comes and goes, keeps a faster split, checks a new split soon, notices a change, lets a smaller
bucket follow a larger one that found splitting slower, and keeps buckets apart."""
from __future__ import annotations

import random

import pytest

from wideep.dbo.auto import AutoSwitch


def _run(auto: AutoSwitch, steps: int, cost, seed: int, tokens: int = 16, decode: bool = True,
         burst: tuple[float, float] | None = None) -> list[bool]:
    """cost(split, step) -> the step's true seconds. Noise: +0-10 % always, +50-150 % on 10 % of
    steps; burst = (p_start, p_end): a load that starts / ends with these odds per step and slows
    every step while it lasts by 1.6-2.6x (another job took one of the cores)."""
    rng = random.Random(seed)
    loaded, splits = False, []
    for i in range(steps):
        split = auto.decide(tokens, decode)
        t = cost(split, i) * (1 + 0.1 * rng.random())
        if rng.random() < 0.1:
            t *= 1.5 + rng.random()
        if burst is not None:
            loaded = rng.random() >= burst[1] if loaded else rng.random() < burst[0]
            t *= 1.6 + rng.random() if loaded else 1.0
        auto.record(tokens, decode, split, t)
        splits.append(split)
    return splits


def _slow_split(split, i):
    return 0.035 if split else 0.02      # a decode step that splits 1.75x slower (bench/dbo.py's)


@pytest.mark.parametrize("seed", range(5))
def test_slower_split_is_tried_rarely(seed):
    """The trials' cost stays within the budget: 1000 steps, about a dozen split steps at most
    (a trial every 50 steps alone would be 20, and as many slow steps again to judge them)."""
    auto = AutoSwitch()
    splits = _run(auto, 1000, _slow_split, seed)
    assert sum(splits) <= 12, sum(splits)
    extra = sum(_slow_split(s, 0) - _slow_split(False, 0) for s in splits)
    assert extra <= 0.01 * 1000 * _slow_split(False, 0), extra   # <= 1 % of the steps' time


def test_a_burst_while_exploring_does_not_make_it_split():
    """Another job's load during the first steps (every step 2.2x slower): steps judged in pairs
    share it, so splitting still looks 1.75x slower. (Four unsplit steps in the burst, then four split
    steps after it, made splitting look faster, and it split until the next retry.)"""
    auto = AutoSwitch()
    splits = _run(auto, 100, lambda split, i: _slow_split(split, i) * (2.2 if i < 4 else 1.0), 0)
    assert sum(splits) <= 2, sum(splits)     # the trial's two split steps, then none until a re-check


@pytest.mark.parametrize("seed", range(8))
def test_load_that_comes_and_goes(seed):
    """Bursts of a few to tens of steps (as while other developers' jobs run): the slower split stays
    off nearly always."""
    auto = AutoSwitch()
    splits = _run(auto, 400, _slow_split, seed, burst=(0.05, 0.1))
    assert sum(splits) <= 8, sum(splits)


@pytest.mark.parametrize("seed", range(5))
def test_faster_split_is_kept(seed):
    auto = AutoSwitch()
    splits = _run(auto, 300, lambda split, i: 0.6 if split else 0.9, seed, tokens=1024, decode=False)
    later = splits[10:]
    assert len(later) - sum(later) <= 20, len(later) - sum(later)   # only the trials' unsplit steps


@pytest.mark.parametrize("seed", range(3))
def test_drift_does_not_flatter_old_samples(seed):
    """Decode steps grow slower as the context grows (here 2x over the run); splitting stays 1.3x
    slower throughout. Each split step is judged against the step before it, not against the past."""
    auto = AutoSwitch()
    splits = _run(auto, 600, lambda split, i: (0.05 + 0.05 * i / 600) * (1.3 if split else 1.0), seed)
    assert sum(splits) <= 12, sum(splits)


def test_a_new_split_is_checked_soon():
    """A first trial fooled into splitting (the unsplit steps of four pairs in five caught by load)
    is re-tried after retry_every steps and goes back to unsplit."""
    auto = AutoSwitch()
    fooled = {0, 4, 6, 8}   # the trial's steps are unsplit at even steps, split at odd ones
    splits = _run(auto, 200, lambda split, i: _slow_split(split, i) * (2.2 if i in fooled else 1.0), 0)
    assert all(splits[10:50]), "the fooled trial should have chosen to split"
    assert not any(splits[80:]), "the re-check did not go back to unsplit"


def test_notices_a_change_and_keeps_buckets_apart():
    auto = AutoSwitch()
    slow_split = {"v": True}
    _run(auto, 100, lambda split, i: (0.075 if split else 0.05) if slow_split["v"] else (0.03 if split else 0.05), 1)
    slow_split["v"] = False    # the network got slower: splitting now wins
    splits = _run(auto, 300, lambda split, i: 0.03 if split else 0.05, 2)
    assert sum(splits[-100:]) >= 90, "did not switch to split"
    # a prefill bucket has its own trial: it starts unsplit
    assert auto.decide(1024, False) is False and auto.bucket(1024, False) != auto.bucket(16, True)


def test_smaller_bucket_follows_a_larger_unsplit_one():
    """64 decode tokens split slower; a later 16-token decode bucket (fewer tokens per microbatch:
    less to hide the communication behind) starts unsplit and tries only after retry_every steps."""
    auto = AutoSwitch()
    _run(auto, 50, _slow_split, 0, tokens=64)
    splits = _run(auto, 49, _slow_split, 1, tokens=16)
    assert not any(splits)
    # a larger bucket is not predicted by a smaller one: it runs its own trial at once
    assert any(_run(auto, 4, _slow_split, 2, tokens=256))


def test_a_vetoed_split_is_not_taken_for_a_pair():
    """A rank below the thresholds vetoed the split: the step ran whole and is recorded so; the trial
    asks again and judges only steps that really ran split."""
    auto = AutoSwitch()
    assert auto.decide(16, True) is False
    auto.record(16, True, False, 0.02)
    assert auto.decide(16, True) is True
    auto.record(16, True, False, 0.02)          # vetoed
    assert auto.decide(16, True) is True        # still the trial's split step to come
    for _ in range(3):
        auto.record(16, True, True, 0.035)
        assert auto.decide(16, True) is False
        auto.record(16, True, False, 0.02)
        auto.decide(16, True)
    assert auto.decide(16, True) is False       # two pairs 1.75x slower ended the trial: unsplit


def test_bad_settings():
    with pytest.raises(ValueError, match=r"0 <= margin \(0.2\) < clear \(0.15\)"):
        AutoSwitch(margin=0.2)
    with pytest.raises(ValueError, match=r"retry_every \(50\) <= max_interval \(10\)"):
        AutoSwitch(max_interval=10)
