"""`wideep serve` with a [disagg] section (1 prefill + 1 decode rank) over real HTTP: completions
equal the single-process reference, /metrics carries the KV-transfer counters, and SIGTERM to every
rank stops both cleanly."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from wideep.launch.server.prometheus import parse
from tests.launch.test_server import (MAX_TOKENS, PROMPTS, ServerProc, complete, reference,  # noqa: F401
                                     request, tiny, write_config)

DISAGG = """
[disagg.prefill]
kv_cache_blocks = 64
[disagg.decode]
kv_cache_blocks = 64
"""


@pytest.mark.multirank
def test_serve_disaggregated(tiny, reference, tmp_path):  # noqa: F811
    path = write_config(tiny, tmp_path, timeout_s=30)
    with open(path) as f:  # the cache size is per pool when disaggregated
        text = f.read().replace("kv_cache_blocks = 64\n", "")
    with open(path, "w") as f:
        f.write(text + DISAGG)
    s = ServerProc(path, ranks=2)
    try:
        jobs = [(i, st) for i in range(len(PROMPTS)) for st in (False, True)]
        with ThreadPoolExecutor(len(jobs)) as ex:
            got = list(ex.map(lambda j: complete(s.base, PROMPTS[j[0]], MAX_TOKENS[j[0]], j[1]), jobs))
        assert [g["token_ids"] for g in got] == [reference[i] for i, _ in jobs]
        status, raw = request(s.base, "GET", "/metrics")
        m = parse(raw.decode())
        assert status == 200 and m["wideep_kv_transfers_total"] == len(jobs)
        assert m["wideep_kv_transfer_bytes_total"] > 0 and m["wideep_prefill_prompt_tokens_in_flight"] == 0
    finally:
        rcs = s.stop(every_rank=True)
    assert rcs == [0, 0], s.output
