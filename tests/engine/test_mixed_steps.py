"""The scheduler's mixed-step size (engine/sched/scheduler.py mixed_step_tokens; EngineConfig.max_mixed_step_tokens):
a step with decodes takes short prompts' tokens only up to that many tokens in all, the rest of a prompt next step;
long prompts, steps without decodes and steps with as many decodes as the size are left alone; every request still
gets all its tokens; the default is the fused CPU step's size; a bad value is named."""
from __future__ import annotations

import pytest

from wideep.engine import SamplingParams
from wideep.engine.sched.block_manager import BlockManager
from wideep.engine.sched.scheduler import Scheduler, StepResult
from wideep.engine.sched.sequence import Sequence
from wideep.kvstore.spec import FULL, KVSpec, StreamSpec

SPEC = KVSpec(4, (StreamSpec("latent", FULL, rows=4),))


def _sched(cap, max_num_seqs: int = 32, budget: int = 512) -> Scheduler:
    return Scheduler(BlockManager(SPEC, {"latent": 4096}, max_chunk=budget), max_num_seqs, budget,
                     mixed_step_tokens=cap)


def _seq(name: str, prompt: int, max_tokens: int = 50) -> Sequence:
    return Sequence(name, None, list(range(1, prompt + 1)), SamplingParams(), max_tokens)


def _step(sched: Scheduler) -> dict[str, int]:
    batch = sched.schedule()
    toks = [7 if s.num_computed + n == s.num_tokens else None for s, n in zip(batch.seqs, batch.num_tokens)]
    B = len(batch.seqs)
    sched.apply(batch, StepResult(toks, [0.0 if t is not None else None for t in toks], [None] * B, [None] * B))
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}


def _decoding(sched: Scheduler, n: int) -> None:
    """n sequences of 3-token prompts admitted and prefilled: decoding from the next step."""
    for i in range(n):
        sched.add(_seq(f"d{i}", 3))
    _step(sched)


def test_a_short_prompt_beside_decodes_is_split_to_the_step_size():
    sched = _sched(16)
    _decoding(sched, 6)
    sched.add(_seq("p", 14))
    sched.add(_seq("q", 9))
    got = _step(sched)
    assert sum(got.values()) == 16 and got["p"] == 10 and "q" not in got   # FCFS: q waits for the room
    got = _step(sched)
    assert got["p"] == 4 and got["q"] == 6 and sum(got.values()) == 16
    got = _step(sched)
    assert got["q"] == 3 and sum(got.values()) == 6 + 1 + 3


def test_long_prompts_steps_without_decodes_and_full_decode_steps_are_left_alone():
    sched = _sched(16)
    sched.add(_seq("a", 30))
    sched.add(_seq("b", 12))
    assert _step(sched) == {"a": 30, "b": 12}          # no decodes: the token budget alone
    sched.add(_seq("long", 40))                        # more pending than the step size: big chunks
    assert _step(sched) == {"a": 1, "b": 1, "long": 40}
    full = _sched(4)
    _decoding(full, 4)
    full.add(_seq("p", 3))
    assert _step(full)["p"] == 3                       # 4 decodes already fill a 4-token step: no limit
    off = _sched(None)
    _decoding(off, 6)
    off.add(_seq("p", 14))
    assert _step(off)["p"] == 14


def test_every_request_gets_all_its_tokens():
    sched = _sched(8, max_num_seqs=6)
    seqs = [_seq(f"s{i}", 2 + (7 * i) % 13, 1 + (5 * i) % 9) for i in range(20)]
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.has_work():
            break
        got = _step(sched)
        assert got, "the scheduler stalled"
    assert not sched.has_work()
    assert all(len(s.output_token_ids) == s.max_tokens for s in seqs)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_mixed_step_size_is_named(bad):
    from wideep.engine.engine_config import EngineConfig
    with pytest.raises(ValueError, match="max_mixed_step_tokens must be an integer >= 0"):
        EngineConfig(model="x", max_mixed_step_tokens=bad)
    with pytest.raises(ValueError, match="mixed_step_tokens must be a positive integer or None"):
        _sched(bad if bad != -1 else 0)


def test_the_default_is_the_fused_cpu_steps_size(tmp_path):
    """64 on the cpu backend; off on the torch one, where the option says 0, and where the plan never fuses a step."""
    from wideep.cpu.build import unusable
    from wideep.engine import LLM
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(str(tmp_path), "v3", num_hidden_layers=2, n_routed_experts=8, n_group=4, topk_group=2,
                             num_experts_per_tok=2, vocab_size=200, seed=1)
    torch_llm = LLM(d, dtype="float32", progress=False, attention_backend="torch", experts_backend="torch")
    assert torch_llm.engine.core.scheduler.mixed_step_tokens is None
    if unusable() is None:
        llm = LLM(d, dtype="float32", progress=False, attention_backend="cpu", experts_backend="cpu")
        assert llm.engine.core.scheduler.mixed_step_tokens == 64
        set_ = LLM(d, dtype="float32", progress=False, attention_backend="cpu", experts_backend="cpu",
                   max_mixed_step_tokens=0)
        assert set_.engine.core.scheduler.mixed_step_tokens is None
        fp8_cache = LLM(d, dtype="float32", progress=False, attention_backend="cpu", kv_cache_dtype="fp8")
        assert fp8_cache.engine.core.scheduler.mixed_step_tokens is None   # the plan never fuses such steps
