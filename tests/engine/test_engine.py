"""Continuous batching under memory pressure: everything finishes, outputs equal each request run
alone, no block leaks; prefix caching on/off equal; abort; bad input keeps the engine serving."""
from __future__ import annotations

import random

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.engine import Engine
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a sharp random model: greedy choices far from ties, so batch shapes cannot flip them
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("serve")), arch="v3", seed=5, initializer_range=0.3)


def workload(n: int, seed: int, max_prompt: int = 300, max_new: int = 64, last_arrival: int = 150):
    rng = random.Random(seed)
    return [dict(id=f"r{i}", prompt=[rng.randrange(2, 256) for _ in range(rng.randint(1, max_prompt))],
                 max_tokens=rng.randint(1, max_new), arrival=rng.randint(0, last_arrival)) for i in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def drive(engine: Engine, reqs: list[dict], check=None) -> dict[str, list[int]]:
    """Feed requests at their arrival steps, step until done. -> final token ids per request."""
    by_step: dict[int, list[dict]] = {}
    for r in reqs:
        by_step.setdefault(r["arrival"], []).append(r)
    done, step = {}, 0
    while step <= max(by_step) or engine.has_unfinished_requests():
        for r in by_step.get(step, []):
            engine.add_request(r["id"], r["prompt"], greedy(r["max_tokens"]))
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out.outputs[0].token_ids
        if check:
            check(engine)
        step += 1
        assert step < 20000, "engine made no progress"
    return done


def alone(model_dir: str, reqs: list[dict]) -> dict[str, list[int]]:
    llm = LLM(model_dir, progress=False, block_size=16, kv_cache_blocks=64, enable_prefix_caching=False)
    return {r["id"]: llm.generate([r["prompt"]], greedy(r["max_tokens"]))[0].outputs[0].token_ids for r in reqs}


@pytest.mark.slow
def test_300_requests_under_preemption_equal_alone_and_leak_nothing(model_dir):
    reqs = workload(320, seed=0)
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=48, max_num_seqs=24,
                 max_num_batched_tokens=256)
    blocks = eng.core.blocks.allocators["latent"]
    peak = {"used": 0}

    def check(e):
        used = blocks.num_blocks - blocks.num_free
        assert used <= blocks.num_blocks and sum(1 for r in blocks.refs if r > 0) == used
        peak["used"] = max(peak["used"], used)

    got = drive(eng, reqs, check)
    assert set(got) == {r["id"] for r in reqs}
    assert all(len(got[r["id"]]) == r["max_tokens"] for r in reqs)
    assert eng.core.scheduler.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    assert peak["used"] == blocks.num_blocks  # the pool was actually exhausted
    assert blocks.num_free == blocks.num_blocks and not any(blocks.refs)  # no leak
    ref = alone(model_dir, reqs)
    bad = [r["id"] for r in reqs if got[r["id"]] != ref[r["id"]]]
    assert not bad, f"{len(bad)} requests differ from running alone, e.g. {bad[:5]}"
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["kv_blocks_used"] == 0
    fin = m["finished_requests"]
    assert len(fin) == len(reqs) and all(f["ttft_s"] is not None and f["queue_s"] is not None for f in fin)


def test_prefix_caching_equal_outputs_and_hits(model_dir):
    rng = random.Random(1)
    system = [rng.randrange(2, 256) for _ in range(70)]  # shared prefix: 4 full blocks of 16
    reqs = [dict(id=f"p{i}", prompt=system + [rng.randrange(2, 256) for _ in range(rng.randint(1, 30))],
                 max_tokens=rng.randint(1, 12), arrival=i // 3) for i in range(24)]
    outs = {}
    for on in (False, True):
        eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=80, enable_prefix_caching=on)
        outs[on] = drive(eng, reqs)
        rate = eng.metrics()["prefix_cache_hit_rate"]
        assert (rate > 0.3) if on else rate == 0.0
    assert outs[True] == outs[False]


def test_cached_tokens_per_request(model_dir):
    """RequestOutput.metrics["cached_tokens"]: the prefix-cache hits of that request at admission
    (whole blocks; the last prompt token is always computed), 0 with prefix caching off."""
    prompt = list(range(100, 140))   # 2 full blocks of 16 + 8
    for on, want in ((True, [0, 32, 32]), (False, [0, 0, 0])):
        eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=40, enable_prefix_caching=on)
        got = []
        for i, p in enumerate([prompt, prompt, prompt[:33] + [7, 8]]):
            eng.add_request(f"c{i}", p, greedy(3))
            while True:
                done = [o for o in eng.step() if o.finished]
                if done:
                    got.append(done[0].metrics["cached_tokens"])
                    break
        assert got == want, (on, got)


def test_abort_frees_blocks_and_others_are_unaffected(model_dir):
    reqs = [dict(id=f"a{i}", prompt=list(range(3 + i, 40 + i)), max_tokens=30, arrival=0) for i in range(4)]
    ref = drive(Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=40), reqs)
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=40, enable_prefix_caching=False)
    for r in reqs:
        eng.add_request(r["id"], r["prompt"], greedy(r["max_tokens"]))
    for _ in range(5):
        eng.step()
    used_before = eng.core.blocks.num_used
    eng.abort("a1")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a1"].finished and outs["a1"].outputs[0].finish_reason == "abort"
    assert eng.core.blocks.num_used < used_before
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert done == {k: v for k, v in ref.items() if k != "a1"}
    assert eng.core.blocks.num_free == eng.core.blocks.allocators["latent"].num_blocks
    with pytest.raises(ValueError, match="unknown request id 'a1'"):
        eng.abort("a1")


def test_bad_requests_are_rejected_and_engine_keeps_serving(model_dir):
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=40, max_model_len=256)
    eng.add_request("ok", [5, 6, 7], greedy(4))
    for rid, prompt, params, match in [
        ("e", [], greedy(4), "empty"),
        ("ok", [1, 2], greedy(4), "duplicate request id 'ok'"),
        ("long", list(range(2, 250)) * 2, greedy(4), "max_model_len=256"),
        ("vocab", [5, 999], greedy(4), "out of range"),
        ("p", [5], "not params", "SamplingParams"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.add_request(rid, prompt, params)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        eng.abort("nope")
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert list(done) == ["ok"] and len(done["ok"]) == 4


def test_delta_outputs_concatenate_to_cumulative(model_dir):
    eng = Engine(model_dir, progress=False, block_size=16, kv_cache_blocks=40)
    eng.add_request("c", [9, 8, 7], greedy(10))
    eng.add_request("d", [9, 8, 7], greedy(10, output_kind="delta"))
    cum, parts = None, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "c":
                cum = o.outputs[0].token_ids
            else:
                parts += o.outputs[0].token_ids
    assert parts == cum and len(cum) == 10


@pytest.mark.parametrize("detokenizer", ["decode_stream", "window"])
def test_streamed_text_never_splits_a_multibyte_character(model_dir, detokenizer, monkeypatch):
    """The tiny tokenizer has one token per UTF-8 byte, so 'é', '€', '你' and '🙂' span 2-4 tokens: streamed
    deltas must hold a partial character back, not send U+FFFD, and concatenate to the full text. (The
    front detokenizes: engine/front/outputs.py, fed the ranks' deltas one token at a time; with tokenizers'
    DecodeStream, and with the decode-window fallback for tokenizers without it.)"""
    import os

    import wideep.engine.front.outputs as front_outputs
    if detokenizer == "window":
        monkeypatch.setattr(front_outputs, "DecodeStream", None)

    from tokenizers import Tokenizer

    from wideep.engine.worker.messages import Delta
    from wideep.engine.front.outputs import RequestState
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    want = "héllo €! 你好 🙂 ok"
    ids = tok.encode(want).ids
    assert len(ids) == len(want.encode())
    states = {kind: RequestState(kind, None, [5], greedy(len(ids), output_kind=kind), len(ids), 0)
              for kind in ("delta", "cumulative")}
    deltas = []
    for i, t in enumerate(ids):
        for kind, st in states.items():
            st.apply(Delta(kind, [t], None, 0.0, "length" if i == len(ids) - 1 else None))
            text = st.output(tok, delta=kind == "delta").outputs[0].text
            assert "\ufffd" not in text, (kind, i, text)
            if kind == "delta":
                deltas.append(text)
            else:
                assert want.startswith(text)
    assert "".join(deltas) == want and text == want
    assert deltas[1] == "" and deltas[2] == "é"          # 'é' waits for its second byte
    # a byte sequence that never completes is shown (as U+FFFD) once the request finishes
    st = RequestState("bad", None, [5], greedy(2, output_kind="delta"), 2, 0)
    st.apply(Delta("bad", [ids[1]], None, 0.0))
    assert st.output(tok, delta=True).outputs[0].text == ""
    st.apply(Delta("bad", [], None, 0.0, "length"))
    assert st.output(tok, delta=True).outputs[0].text == "\ufffd"
