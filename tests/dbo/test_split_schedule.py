"""DBO's pure parts: the microbatch split and the overlap executor (with fake stages)."""
from __future__ import annotations

import random

import pytest

from wideep.dbo.schedule import YIELD, run_overlapped, run_sequential
from wideep.dbo.split import SplitConfig, can_split, split


def _tokens(parts):
    return sum(hi - lo for _, lo, hi in parts)


def test_docstring_example():
    assert split([5, 1, 2]) == ([(0, 0, 4)], [(0, 4, 5), (1, 0, 1), (2, 0, 2)])


@pytest.mark.parametrize("seed", range(30))
def test_split_is_balanced_complete_and_ordered(seed):
    rng = random.Random(seed)
    decode = seed % 3 == 0
    n = [1] * rng.randint(2, 40) if decode else [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
    if sum(n) < 2:
        return
    a, b = split(n)
    assert a and b
    if decode:
        assert abs(len(a) - len(b)) <= 1
    else:
        assert abs(_tokens(a) - _tokens(b)) <= 1
    covered = {}
    for seq, lo, hi in a + b:
        covered.setdefault(seq, []).append((lo, hi))
    for seq, count in enumerate(n):  # every token exactly once, microbatch 0's part of a cut sequence first
        spans = covered[seq]
        assert spans[0][0] == 0 and spans[-1][1] == count
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def test_thresholds():
    cfg = SplitConfig(decode_token_threshold=4, prefill_token_threshold=64)
    assert not can_split([1, 1, 1], cfg) and can_split([1] * 4, cfg)
    assert not can_split([30, 1], cfg) and can_split([63, 1], cfg)
    with pytest.raises(ValueError, match="thresholds must be >= 2"):
        SplitConfig(decode_token_threshold=1)


def _layer(name: str, log: list):
    def op(tag):
        return lambda s: log.append(f"{tag}{s['mb']}")
    return [op(f"{name}.attn"), op(f"{name}.dispatch"), YIELD, op(f"{name}.experts"), YIELD, op(f"{name}.combine")]


def test_two_microbatches_interleave_as_the_decode_pipeline():
    log: list[str] = []
    ops = _layer("L0", log) + _layer("L1", log)
    run_overlapped(ops, [{"mb": 0}, {"mb": 1}])
    assert log == ["L0.attn0", "L0.dispatch0", "L0.attn1", "L0.dispatch1",
                   "L0.experts0", "L0.experts1",
                   "L0.combine0", "L1.attn0", "L1.dispatch0", "L0.combine1", "L1.attn1", "L1.dispatch1",
                   "L1.experts0", "L1.experts1", "L1.combine0", "L1.combine1"]


def test_one_state_and_sequential_run_everything_in_order():
    log: list[str] = []
    ops = _layer("L0", log)
    run_overlapped(ops, [{"mb": 0}])
    run_sequential(ops, {"mb": 9})
    assert log == ["L0.attn0", "L0.dispatch0", "L0.experts0", "L0.combine0",
                   "L0.attn9", "L0.dispatch9", "L0.experts9", "L0.combine9"]
