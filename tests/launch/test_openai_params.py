"""The official `openai` client against `wideep serve` (127.0.0.1, a tiny checkpoint with a
tokenizer): stop strings (with stop_reason and include_stop_str_in_output, streamed too), n=2,
batched prompts, and echo + logprobs in the shape lm-eval's loglikelihood reads (max_tokens 1 and 0)."""
from __future__ import annotations

import pytest

from wideep.engine import LLM, SamplingParams
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from tests.launch.test_server import ServerProc, write_config

openai = pytest.importorskip("openai")
PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), arch="v3", seed=4)


@pytest.fixture(scope="module")
def client(tiny, tmp_path_factory):
    s = ServerProc(write_config(tiny, tmp_path_factory.mktemp("cfg")))
    try:
        yield openai.OpenAI(base_url=f"http://{s.base}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        assert s.stop() == [0], s.output


@pytest.fixture(scope="module")
def greedy_text(tiny):
    """The greedy completion's text after each token count, and a stop string from its middle."""
    llm = LLM(tiny, progress=False, max_model_len=128, kv_cache_blocks=64)
    ids = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    texts = [llm.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    for k in range(3, len(ids)):
        a, b = texts[k - 1], texts[k]
        stop = b[len(a) - 1:len(a) + 1]
        if "\ufffd" not in b and len(b) > len(a) > 0 and b.startswith(a) and b.find(stop) == len(a) - 1:
            llm.shutdown()
            return texts[k], stop
    pytest.skip("no clean token boundary in the greedy text")


def test_stop_strings(client, greedy_text):
    text, stop = greedy_text
    pos = text.find(stop)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(stop=["zzzz", stop], **kw)
    c = r.choices[0]
    assert c.text == text[:pos] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    r = client.completions.create(stop=stop, **dict(kw, extra_body={"ignore_eos": True,
                                                                   "include_stop_str_in_output": True}))
    assert r.choices[0].text == text[:pos + len(stop)]
    shown = ""
    for chunk in client.completions.create(stop=[stop + "longer", stop], stream=True, **kw):
        shown += chunk.choices[0].text
        assert text[:pos].startswith(shown)
    assert shown == text[:pos] and chunk.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="at most 128"):
        client.completions.create(stop=["x"] * 1000, **kw)


def test_n2_and_batched_prompts(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 16
    r = client.completions.create(model="tiny", prompt=[PROMPT, [5, 6, 7]], max_tokens=3, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    one = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == r.choices[2].text
    seen = {}
    for chunk in client.completions.create(model="tiny", prompt=[PROMPT, "abc"], max_tokens=4, n=2, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            seen.setdefault(c.index, []).append(c.finish_reason)
    assert sorted(seen) == [0, 1, 2, 3] and all(v[-1] == "length" for v in seen.values())


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_as_lm_eval_reads_it(client, max_tokens):
    ctx, cont = "hello", " world"
    r = client.completions.create(model="tiny", prompt=ctx + cont, max_tokens=max_tokens, echo=True, logprobs=1,
                                  temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert c.text.startswith(ctx + cont) and r.usage.completion_tokens == max_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) \
        == n_prompt + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # lm-eval: sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs (the last is the generated)
    for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert tok in top.values()   # the scored token is among its own top_logprobs
    lm_eval = client.completions.create(model="tiny", prompt=ctx + cont, max_tokens=1, echo=True, logprobs=1,
                                        temperature=0)
    assert lm_eval.choices[0].logprobs.token_logprobs[:n_prompt] == lp.token_logprobs[:n_prompt]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_with_n2_every_choice_has_the_prompt_logprobs(client, stream):
    kw = dict(model="tiny", prompt="hello world", max_tokens=2, echo=True, logprobs=1, n=2, temperature=1.0)
    if not stream:
        choices = client.completions.create(**kw).choices
    else:
        first = {}
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                first.setdefault(c.index, c)   # the echoed prompt comes in each choice's first chunk
        choices = [first[i] for i in sorted(first)]
    assert [c.index for c in choices] == [0, 1]
    for c in choices:
        assert c.text.startswith("hello world")
        lps = c.logprobs.token_logprobs
        assert lps[0] is None and all(v is not None for v in lps[1:])
