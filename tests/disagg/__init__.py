"""Disaggregated prefill/decode tests; prefill_hits: shared by those that check the prefill rank's prefix cache."""
from __future__ import annotations

import time


def prefill_hits(eng, at_least: int = 1, timeout_s: float = 30.0) -> int:
    """The first prefill rank's prefix-cache hit tokens as the front knows them, waiting up to timeout_s for them to
    reach at_least: a rank's stats come with its next report (on going idle, or periodically), which a loaded
    machine may deliver after the decode rank has finished every request."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = eng.metrics()["pools"]["prefill"]["per_rank"][0] or {}
        hits = st.get("prefix_hit_tokens", 0)
        if hits >= at_least or time.monotonic() >= deadline:
            return hits
        eng.front.poll(0.2)
