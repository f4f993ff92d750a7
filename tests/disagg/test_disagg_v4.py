"""Disaggregated DeepSeek-V4: each layer's streams travel layer by layer (attention_v4/transfer.py: the compressed
entries and indexer keys a chunk closes, then with the prompt's last chunk the window tail and the compressor
states). 1 prefill + 1 decode rank: what the decode rank holds after a transfer (every layer's entries, keys, window
tail and slot states) equals what it computes itself, with chunked prefills ending mid-window and prefix-cache hits
on the prefill rank, and every request's tokens equal a single process's."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from tests.disagg import prefill_hits
from tests.parallel.spawn import spawn

POOLS = {"prefill": {"dp_size": 1, "ep_size": 1, "max_num_batched_tokens": 19, "kv_cache_blocks": 40},
         "decode": {"dp_size": 1, "ep_size": 1, "kv_cache_blocks": 40}}
BS = 8


def requests() -> list[dict]:
    rng = random.Random(5)
    system = [rng.randrange(2, 200) for _ in range(40)]   # boundaries of 16 tokens: hits of 32 on the prefill rank
    reqs = [dict(id=f"s{i}", prompt=system + [rng.randrange(2, 200) for _ in range(5 + 9 * i)], max_tokens=8,
                 arrival=8 * i) for i in range(3)]
    reqs.append(dict(id="chunked", prompt=[rng.randrange(2, 200) for _ in range(75)], max_tokens=8, arrival=1))
    reqs.append(dict(id="short", prompt=[7, 9, 11], max_tokens=8, arrival=2))
    return reqs


def _held(core, seq, n: int) -> list:
    """Every layer's rows a decode from token n reads: entries, keys, window tail, slot states."""
    from wideep.attention_v4.transfer import gather, pieces
    return [layer._read(name, t) for layer in core.kv.views(seq)   # fp8: the packed rows decoded
            for (name, *_), t in zip(pieces(layer, 0, n, True), gather(layer, 0, n, True))]


def _backend(kv: str) -> str:
    """fp8: the torch projections on both sides (the C GEMM's sums differ from BLAS's in the last bit at other row
    counts, and an fp8 entry rounded from such a value may move a code; this test is about what travels)."""
    return "torch" if kv == "fp8" else "auto"


def _rank(model_dir: str, pools: dict = POOLS, kv: str = "auto") -> dict | str:
    from wideep.disagg import make_engine
    from tests.engine.test_engine import drive
    eng = make_engine(model_dir, pools, progress=False, block_size=BS, dtype="float32", kv_cache_dtype=kv,
                      parallel={"timeout_s": 60.0}, attention_backend=_backend(kv))
    if not eng.is_front:
        return eng.run_worker_loop()
    core = eng.core
    received, finish = {}, eng.receiver._finish

    def spy(inc, trailer):
        finish(inc, trailer)
        received[inc.seq.request_id] = [t.clone() for t in _held(core, inc.seq, len(inc.seq.prompt_token_ids))]
    eng.receiver._finish = spy
    reqs = requests()
    got = drive(eng, reqs)
    hits = prefill_hits(eng)
    m = eng.metrics()
    nbytes = {f["request_id"]: f["kv_transfer_bytes"] for f in m["finished_requests"]}
    eng.shutdown()
    return {"got": got, "received": received, "hits": hits, "bytes": nbytes}


def _computed_alone(model_dir: str, reqs, kv: str = "auto") -> dict:
    """The rows one process (no prefix cache) holds after each prompt's prefill."""
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, block_size=BS, dtype="float32", enable_prefix_caching=False, max_num_seqs=1,
              kv_cache_dtype=kv, attention_backend=_backend(kv))
    eng, out = llm.engine, {}
    for r in reqs:
        eng.add_request(r["id"], r["prompt"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        eng.step()   # the prefill (one chunk) and the first token
        out[r["id"]] = [t.clone() for t in _held(eng.core, eng.core.scheduler.running[0], len(r["prompt"]))]
        while eng.has_unfinished_requests():
            eng.step()
    llm.shutdown()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.oracle_v4 import make_v4_model
    d = str(tmp_path_factory.mktemp("disagg_v4"))
    make_v4_model(d)
    return d


def _alone(model_dir: str, reqs, kv: str = "auto") -> dict:
    from wideep.engine import LLM, SamplingParams
    llm = LLM(model_dir, progress=False, dtype="float32", enable_prefix_caching=False, kv_cache_dtype=kv,
              attention_backend=_backend(kv))
    return {r["id"]: llm.generate([r["prompt"]], SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                                                ignore_eos=True))[0].outputs[0].token_ids
            for r in reqs}


@pytest.mark.multirank
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_v4_streams_travel_layer_by_layer(model_dir, kv):
    """(fp8: the packed rows travel as stored: the decode rank's bytes equal its own computation's.)"""
    front, prefill = spawn(_rank, 2, args=(model_dir, POOLS, kv), timeout_s=400)
    assert prefill == "shutdown"
    reqs = requests()
    assert front["got"] == _alone(model_dir, reqs, kv)
    assert front["hits"] > 0, "the shared prefix was meant to hit the prefill rank's cache"
    mine = _computed_alone(model_dir, reqs, kv)
    for rid, rows in front["received"].items():
        assert len(rows) == len(mine[rid]) > 0
        # fp8: a value a rounding apart in float32 may land one e4m3 step (1/8 relative at most) apart
        rel = 0.0 if kv == "auto" else 0.125
        diff = max(((a - b).abs() - rel * b.abs()).max().item() for a, b in zip(rows, mine[rid]))
        assert diff <= 1e-5, (rid, diff)
        size = sum(t.numel() * t.element_size() for t in rows)   # (decoded: fp8 moves fewer bytes than this)
        assert front["bytes"][rid] >= size if kv == "auto" else 0 < front["bytes"][rid] < size   # everything it holds came over (window rows of earlier chunks too)


@pytest.mark.multirank
def test_v4_two_prefill_and_two_decode_ranks(model_dir):
    """2 prefill ranks (EP2) + 2 decode ranks (EP2): the experts are split within each pool, the streams still go
    from the prefill rank that computed them to the decode rank the front chose; tokens equal one process's."""
    pools = {"prefill": dict(POOLS["prefill"], dp_size=2, ep_size=2),
             "decode": dict(POOLS["decode"], dp_size=2, ep_size=2)}
    ranks = spawn(_rank, 4, args=(model_dir, pools), timeout_s=400)
    front = ranks[0]
    assert front["got"] == _alone(model_dir, requests())
    assert front["bytes"] and all(b > 0 for b in front["bytes"].values())


@pytest.mark.multirank
def test_v4_mtp_with_disaggregation_is_refused_on_every_rank(model_dir):
    """Not built yet (the MTP block's window rows would have to travel with the streams): the same error on every
    rank, before connecting; n-gram drafting is what V4 pools take (tests/disagg/test_disagg_spec.py has it)."""
    from tests.disagg.test_disagg_errors import ONE_ONE, _build
    from tests.parallel.spawn import run
    opts = {r: {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}} for r in range(2)}
    for o in run(_build, 2, args=(model_dir, {"all": ONE_ONE}, opts), timeout_s=90):
        assert o.returncode not in (0, None), (o.rank, o.stderr[-1500:])
        assert ("DeepSeek-V4 does not support speculative method 'mtp' with prefill/decode disaggregation"
                in (o.error or o.stderr))
