"""AsyncEngine without HTTP: concurrent generate() calls equal LLM.generate (greedy), delta outputs
concatenate to the cumulative one, bad input raises in the caller while the engine keeps serving,
cancellation/break/abort free the request, shutdown ends streams, a failed step fails the callers,
and an idle engine steps only with an explicit keepalive."""
from __future__ import annotations

import asyncio
import contextlib
import time
import types

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.engine.front.async_engine import AsyncEngine, EngineDeadError
from wideep.engine.front.engine import Engine
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

PROMPTS = [[5, 6, 7], list(range(2, 40)), [9] * 70, [200, 100, 50, 25, 12]]
MAX_TOKENS = [12, 5, 9, 1]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=2)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, progress=False, max_model_len=128)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])]


@pytest.fixture(scope="module")
def aengine(tiny):
    a = AsyncEngine(Engine(tiny, progress=False, max_model_len=128))
    yield a
    a.close(timeout_s=30)


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def collect(a: AsyncEngine, prompt, params, request_id=None) -> list:
    return [o async for o in a.generate(prompt, params, request_id)]


async def settled(a: AsyncEngine, aborted_before: int, timeout_s: float = 20.0) -> dict:
    """Wait until one more request has been aborted and nothing is left running or holding blocks."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        m = await a.metrics()
        if (m["requests_finished"].get("abort", 0) > aborted_before and m["active_requests"] == 0
                and m["running"] == 0 and m["kv_blocks_used"] == 0):
            return m
        assert loop.time() < end, f"request was not aborted: {m}"
        await asyncio.sleep(0.05)


def test_concurrent_generate_matches_llm(aengine, reference):
    async def main():
        return await asyncio.gather(*[collect(aengine, p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)])
    results = run(main())
    for outs, want, n in zip(results, reference, MAX_TOKENS):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == want
        assert outs[-1].outputs[0].finish_reason in ("length", "stop")
        assert outs[-1].metrics["ttft_s"] is not None


def test_delta_concatenates_to_cumulative(aengine, reference):
    async def main():
        jobs = []
        for p, n in zip(PROMPTS, MAX_TOKENS):
            for kind in ("delta", "cumulative", "final_only"):
                jobs.append(collect(aengine, p, greedy(n, output_kind=kind, logprobs=1)))
        return await asyncio.gather(*jobs)
    results = run(main())
    for i, want in enumerate(reference):
        delta, cum, final = results[3 * i: 3 * i + 3]
        toks = [t for o in delta for t in o.outputs[0].token_ids]
        assert toks == want == cum[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
        assert sum(len(o.outputs[0].logprobs) for o in delta) == len(want)
        assert len(final) == 1 and final[0].finished
        for prev, nxt in zip(cum, cum[1:]):  # cumulative outputs only ever extend
            assert nxt.outputs[0].token_ids[:len(prev.outputs[0].token_ids)] == prev.outputs[0].token_ids


@pytest.mark.parametrize("prompt,params,match", [
    ([], greedy(4), "empty"),
    ([1, 10 ** 6], greedy(4), "out of range"),
    (list(range(1, 130)), greedy(4), "max_model_len"),
    ([1, 2, 3], greedy(200), "exceeds the context"),
    ("a" * 3, "not params", "SamplingParams"),
])
def test_bad_input_raises_in_caller(aengine, reference, prompt, params, match):
    async def main():
        with pytest.raises(ValueError, match=match):
            await collect(aengine, prompt, params)
        return await collect(aengine, PROMPTS[0], greedy(MAX_TOKENS[0]))
    assert run(main())[-1].outputs[0].token_ids == reference[0]


def test_duplicate_id_rejected_without_touching_the_live_request(aengine, reference):
    async def main():
        # the duplicate goes in as soon as the live request has produced its first token: it has ~120
        # decode steps left then, so it is still live however fast the machine (a fixed sleep was not:
        # a faster CPU decode finished it first)
        live = aengine.generate(PROMPTS[0], greedy(120, ignore_eos=True), "dup")
        first = await live.__anext__()
        with pytest.raises(ValueError, match="duplicate"):
            await collect(aengine, PROMPTS[1], greedy(4), request_id="dup")
        return [first] + [o async for o in live]
    outs = run(main())
    got = outs[-1].outputs[0]
    assert got.token_ids[:MAX_TOKENS[0]] == reference[0] and got.finish_reason == "length"


@pytest.mark.parametrize("how", ["cancel", "break", "abort"])
def test_stopping_early_aborts_and_frees_blocks(aengine, how):
    async def main():
        before = (await aengine.metrics())["requests_finished"].get("abort", 0)
        params = greedy(120, ignore_eos=True, output_kind="delta")
        seen, two = [], asyncio.Event()

        async def consume():
            async for o in aengine.generate([3, 4, 5], params, request_id=f"long-{how}"):
                seen.append(o)
                if len(seen) == 2:
                    two.set()   # no polling interval for a fast decode to run the request out in
                    if how == "break":
                        break
                    if how == "abort":
                        aengine.abort(f"long-{how}")
        task = asyncio.create_task(consume())
        await two.wait()
        if how == "cancel":
            task.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel" else contextlib.nullcontext():
            await task
        m = await settled(aengine, before)
        return seen, m
    seen, m = run(main())
    if how == "abort":  # an abort by id ends the stream with the abort output
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in seen) < 120


def test_shutdown_ends_streams_and_refuses_new_work(tiny):
    a = AsyncEngine(Engine(tiny, progress=False, max_model_len=128))

    async def main():
        outs, first = [], asyncio.Event()

        async def consume():
            async for o in a.generate([7, 8], greedy(120, ignore_eos=True, output_kind="delta")):
                outs.append(o)
                first.set()
        task = asyncio.create_task(consume())
        await first.wait()
        await a.shutdown()
        await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await collect(a, [1, 2], greedy(2))
        with pytest.raises(EngineDeadError):
            await a.metrics()
    run(main())
    assert not a.is_running and a.error is None


class FakeEngine:
    """Just enough of Engine for AsyncEngine: counts steps; can fail a step."""

    def __init__(self, single: bool = True, fail_after: int | None = None):
        self.is_front = True
        self.ctx = types.SimpleNamespace(is_single=single, timeout_s=0.4, rank=0)
        self.steps, self.fail_after, self.live, self.shut = 0, fail_after, set(), False

    def add_request(self, rid, prompt, params):
        self.live.add(rid)

    def abort(self, rid):
        self.live.discard(rid)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self, timeout_s=0.05):
        self.steps += 1
        if self.fail_after is not None and self.steps > self.fail_after:
            raise RuntimeError("rank 1 lost")
        return []

    def metrics(self):
        return {}

    def shutdown(self):
        self.shut = True


def test_failed_step_fails_every_caller():
    fake = FakeEngine(fail_after=3)
    a = AsyncEngine(fake)

    async def main():
        with pytest.raises(EngineDeadError, match="rank 1 lost"):
            await asyncio.gather(collect(a, [1], None), collect(a, [2], None))
    run(main(), timeout_s=20)
    a.close(timeout_s=10)
    assert isinstance(a.error, RuntimeError) and fake.shut and not a.is_running


def test_idle_engine_steps_only_with_a_keepalive():
    # Workers wait for rank 0 on the engine's doorbell (tests/engine/test_idle_front.py), so an
    # idle AsyncEngine runs no empty steps unless asked to.
    idle = FakeEngine(single=False)
    b = AsyncEngine(idle)
    time.sleep(0.3)
    b.close(timeout_s=10)
    assert idle.steps == 0 and idle.shut
    fake = FakeEngine(single=False)
    a = AsyncEngine(fake, keepalive_s=0.1)
    time.sleep(1.0)
    a.close(timeout_s=10)
    assert fake.steps >= 3 and fake.shut
