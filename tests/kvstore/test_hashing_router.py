"""Block hashes are stable (other processes, other hash seeds), extend a known chain, and follow the
prefix rule; the front's index follows the ranks' events; routing picks the rank holding the prefix
unless load outweighs it; a rank's events are changes only, bounded per report."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wideep.kvstore.events import HeldLog, KVEvents
from wideep.kvstore.hashing import chain, from_hex, hex_of, prefix_chain
from wideep.kvstore.router import PrefixRouter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_chain_is_the_same_in_other_processes_and_hash_seeds():
    tokens = list(range(100, 164))
    here = [hex_of(h) for h in chain(tokens, 16, 4)]
    code = "from wideep.kvstore.hashing import chain, hex_of; print(*[hex_of(h) for h in chain(list(range(100, 164)), 16, 4)])"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                             env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO))
        assert out.stdout.split() == here, out.stderr
    assert len(set(here)) == 4


def test_chain_extends_known_and_names_the_whole_prefix():
    a = list(range(2, 66))
    b = a[:40] + [7] + a[41:]
    ca, cb = chain(a, 16, 4), chain(b, 16, 4)
    assert ca[:2] == cb[:2] and all(x != y for x, y in zip(ca[2:], cb[2:]))  # block 2 differs, and all after it
    assert chain(a, 16, 4, known=ca[:3]) == ca
    assert chain(a, 16, 2) == ca[:2]
    assert len(prefix_chain(a, 16)) == 3          # 64 tokens: the last token is always computed
    assert len(prefix_chain(a[:63], 16)) == 3 and len(prefix_chain(a[:65] + [9], 16)) == 4
    assert from_hex(hex_of(ca[0])) == ca[0]
    with pytest.raises(ValueError, match="4 blocks of 16 need 64 tokens, got 40"):
        chain(a[:40], 16, 4)
    with pytest.raises(ValueError, match="not a block hash"):
        from_hex("abc")


def _held(log: HeldLog, held: set[int]) -> KVEvents | None:
    return log.take(lambda h: h in held)


def test_held_log_reports_changes_only_and_bounded():
    log = HeldLog(limit=3)
    held = {1, 2, 3, 4, 5}
    for h in (1, 2, 3, 4, 5, 1):
        log.mark(h)
    ev = _held(log, held)
    assert ev.stored == [1, 2, 3] and ev.removed == [] and log.pending
    assert _held(log, held).stored == [4, 5] and not log.pending
    assert _held(log, held) is None
    held -= {2}
    log.mark(2)
    log.mark(3)   # still held: nothing to say
    ev = _held(log, held)
    assert ev.stored == [] and ev.removed == [2]
    off = HeldLog(enabled=False)
    off.mark(1)
    assert not off.pending and _held(off, {1}) is None


def test_router_index_and_choice():
    r = PrefixRouter(block_size=4, prefix_weight=1.0, load_weight=1.0)
    prompt = list(range(2, 23))                      # 21 tokens: 5 full blocks, all usable
    hashes = prefix_chain(prompt, 4)
    r.update(1, KVEvents(stored=hashes[:3]))         # rank 1 holds 3 blocks (12 tokens)
    r.update(2, KVEvents(stored=hashes[:1] + hashes[2:5]))   # rank 2: block 0, then a gap
    assert r.matched(hashes, [0, 1, 2]) == {0: 0, 1: 3, 2: 1}
    assert r.blocks == {1: 3, 2: 4}
    load = {0: 0, 1: 5, 2: 0}
    assert r.choose([0, 1, 2], load, prompt) == (1, "prefix", 12)      # 5 - 12 < 0 - 4
    assert r.choose([0, 1, 2], {0: 0, 1: 20, 2: 0}, prompt) == (2, "load", 4)
    assert r.choose([0, 2], load, prompt) == (2, "prefix", 4)          # only the pool's ranks count
    assert r.choose([0, 1, 2], load, [9] * 21) == (0, "no_prefix", 0)  # nothing cached: least loaded
    r.update(1, KVEvents(removed=hashes[1:2]))
    assert r.matched(hashes, [1]) == {1: 1}
    r.forget_rank(2)
    assert r.matched(hashes, [0, 1, 2]) == {0: 0, 1: 1, 2: 0} and 2 not in r.blocks
    assert r.decisions == {"prefix": 2, "load": 1, "no_prefix": 1}
    lazy = PrefixRouter(4, prefix_weight=0.0)
    lazy.update(1, KVEvents(stored=hashes))
    assert lazy.choose([0, 1], {0: 0, 1: 1}, prompt)[0] == 0            # weight 0: load alone
