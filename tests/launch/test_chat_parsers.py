"""The chat pieces on scripted text (random weights never write this markup): the reasoning split by token
id, streamed token by token, equals the whole split, tool calls of each DeepSeek format parse (and a
malformed block stays text; two calls stream one at a time), DeepSeek-V3.2's encoding, and
ChatOutput on the front's text."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from wideep.launch.chat import reasoning, tool_parsers
from wideep.launch.chat.dsv32_encoding import encode_messages
from wideep.launch.chat.output import ChatOutput, OutputFormat
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
from wideep.structured.backend import special_token_ids

V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
V32 = ('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
       'Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')


def replay(tok, ids: list[int], fmt_kw: dict, skip: bool = True, eos: int | None = None) -> list[dict]:
    """ids through the front's RequestState one token per delta (its detokenizer, skip_special_tokens as
    given, the last token the stop token when eos) into a ChatOutput -> the deltas it returned."""
    from wideep.engine.front.outputs import RequestState
    from wideep.engine.sampling_params import SamplingParams
    from wideep.engine.worker.messages import Delta
    st = RequestState("r", None, [1], SamplingParams(skip_special_tokens=skip, output_kind="delta"), 4096, 0,
                      eos_token_ids=(eos,) if eos is not None else ())
    fmt = OutputFormat(decode=lambda x: tok.decode(x, skip_special_tokens=skip), think_id=tok.token_to_id("<think>"),
                       end_id=tok.token_to_id("</think>"), **fmt_kw)
    out, deltas = ChatOutput(fmt), []
    for i, t in enumerate(ids):
        st.apply(Delta("r", [t], None, 0.0, "stop" if i == len(ids) - 1 else None))
        o = st.output(tok, delta=True).outputs[0]
        deltas.append(out.feed(o.text, o.token_ids, final=st.finished))
    deltas.append({"ended": out.ended_reasoning})
    return deltas


def joined(deltas: list[dict]) -> tuple[str, str, list]:
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas),
            [c for d in deltas for c in d.get("tool_calls", [])])


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """The tiny checkpoints' byte tokenizer: <think>, </think> and the V3 markup are special tokens."""
    return Tokenizer.from_file(f"{make_tiny_checkpoint(str(tmp_path_factory.mktemp('r1')), chat_template_style='r1')}"
                               "/tokenizer.json")


@pytest.mark.parametrize("text,reason,answer", [("abc</think>answer", "abc", "answer"),
                                                ("<think>\nabc</think>answer", "\nabc", "answer"),
                                                ("no end", "no end", None), ("</think>x", "", "x"),
                                                ("a<｜User｜>b</think><｜Assistant｜>c", "ab", "c")])
@pytest.mark.parametrize("skip", [True, False])
def test_reasoning_split_by_token_id(tiny_tok, text, reason, answer, skip):
    """Token by token equals the whole; a leading <think> token is dropped; no </think> token: content null;
    the texts follow skip_special_tokens (no special token's text in them when it is true)."""
    ids = tiny_tok.encode(text, add_special_tokens=False).ids
    deltas = replay(tiny_tok, ids, dict(in_reasoning=True, tool_parser=None), skip=skip)
    r, c, _ = joined(deltas)
    whole = ChatOutput(OutputFormat(True, None, lambda x: tiny_tok.decode(x, skip_special_tokens=skip),
                                    tiny_tok.token_to_id("<think>"), tiny_tok.token_to_id("</think>")))
    d = whole.feed(tiny_tok.decode(ids, skip_special_tokens=skip), ids, final=True)
    assert (d["reasoning_content"], d["content"]) == (r, c)
    assert deltas[-1]["ended"] == (answer is not None)
    if skip:
        assert (r, c or None) == (reason, answer or None)
    else:
        assert r.replace("<｜User｜>", "") == reason and c.replace("<｜Assistant｜>", "") == (answer or "")


def test_think_spelled_in_ordinary_tokens_is_text(tiny_tok):
    """Only the </think> token ends the reasoning; the same characters in byte tokens are reasoning text."""
    plain = [i for ch in "</think>" for i in tiny_tok.encode(ch, add_special_tokens=False).ids]
    ids = tiny_tok.encode("a", add_special_tokens=False).ids + plain + tiny_tok.encode("b</think>c").ids
    r, c, _ = joined(replay(tiny_tok, ids, dict(in_reasoning=True, tool_parser=None)))
    assert (r, c) == ("a</think>b", "c")


@pytest.mark.parametrize("parser,markup", [("deepseek_v3", V3), ("deepseek_v31", V31), ("deepseek_v32", V32)])
def test_tool_calls_parse(parser, markup):
    content, calls = tool_parsers.parse(parser, "Let me check." + markup + "<｜end▁of▁sentence｜>")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    broken = "Let me check." + markup.replace("Paris", "Paris\"{").replace("string=\"true\"", "string=\"false\"")
    assert tool_parsers.parse(parser, broken) == (broken, [])  # malformed: returned as text
    cut = "x" + markup[:markup.index("Paris") + 3]   # cut off inside the call: text
    assert tool_parsers.parse(parser, cut) == (cut, [])
    content, calls = tool_parsers.parse(parser, "x" + markup[:-5])   # cut off after a whole call (max_tokens)
    assert content == "x" and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("parser,markup", [("deepseek_v3", V3), ("deepseek_v31", V31), ("deepseek_v32", V32)])
def test_two_calls_stream_one_at_a_time(parser, markup):
    """Each call is sent once it is whole: the first before the second is written; a malformed
    second call after a good first one comes back as text, the first stays a call."""
    begin, end = tool_parsers.start_marker(parser), markup[markup.rindex("<"):]
    call = markup[markup.index(begin) + len(begin):markup.rindex("<")]
    two = markup[:markup.index(begin)] + begin + call + call.replace("Paris", "Rome") + end
    out, seen = tool_parsers.ToolCallStream(parser), []
    for i, ch in enumerate(two):
        _, calls = out.feed(ch, final=i == len(two) - 1)
        d = {"tool_calls": [c.openai(len(out.calls) - len(calls) + k) for k, c in enumerate(calls)]}
        seen += [(i, tc["index"], json.loads(tc["function"]["arguments"])["city"]) for tc in d["tool_calls"]]
    assert [s[1:] for s in seen] == [(0, "Paris"), (1, "Rome")]
    assert seen[0][0] < two.index("Rome")   # the first went out before the second was written
    bad = markup[:markup.index(begin)] + begin + call + call.replace("Paris", "Rome\"{").replace(
        'string="true"', 'string="false"') + end
    content, calls = tool_parsers.parse(parser, "x" + bad)
    assert [c.name for c in calls] == ["get_weather"] and content.startswith("x")
    assert "Rome" in content and json.loads(calls[0].arguments) == {"city": "Paris"}


def test_dsv32_encoding():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "reasoning_content": "r",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "sunny"}]
    text = encode_messages(msgs, tools=tools, thinking=True)
    assert text.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")
    assert "<｜User｜>hi<｜Assistant｜><think>r</think>" in text  # the last user turn opens thinking
    assert V32 in text and text.endswith("<result>sunny</result>\n</function_results>\n\n<think>")
    assert encode_messages([{"role": "user", "content": "hi"}]) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    assert encode_messages([{"role": "user", "content": "hi"}], thinking=True).endswith("<｜Assistant｜><think>")


def test_chat_output_on_the_fronts_text(tiny_tok):
    """The chat output reads the front's deltas token by token (a multi-byte character split across tokens
    included): the V3 markup is special in this tokenizer, so the front keeps special tokens for the parser
    and the chat output takes the other ones out of the reasoning and the answer."""
    specials = tuple(tiny_tok.id_to_token(i) for i in sorted(special_token_ids(tiny_tok)))
    ids = tiny_tok.encode("hmm<｜User｜> é</think>Sure.<｜Assistant｜>" + V3, add_special_tokens=False).ids \
        + [tiny_tok.token_to_id(tool_parsers.EOS)]
    deltas = replay(tiny_tok, ids, dict(in_reasoning=True, tool_parser="deepseek_v3", strip=specials), skip=False,
                    eos=ids[-1])
    r, c, calls = joined(deltas)
    assert r == "hmm é" and c == "Sure."
    assert [tc["function"]["name"] for tc in calls] == ["get_weather"]


@pytest.mark.parametrize("style", ["v3", "r1", "v31"])
def test_template_renders_as_transformers_does(style, tmp_path):
    """transformers' apply_chat_template is the oracle for the rendering (sandbox, globals, tojson)."""
    transformers = pytest.importorskip("transformers")
    from wideep.launch.chat.chat_template import load_chat_template
    d = make_tiny_checkpoint(str(tmp_path), chat_template_style=style)
    tools = [{"type": "function", "function": {"name": "f", "description": "é", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "done"}]
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ours = load_chat_template(d)
    for kw in ({}, {"thinking": True}):
        for gen, cont, m in ((True, False, msgs[:4]), (False, True, msgs)):
            want = hf.apply_chat_template(m, tools=tools, tokenize=False, add_generation_prompt=gen,
                                          continue_final_message=cont, **kw)
            assert ours.render(m, tools=tools, add_generation_prompt=gen, continue_final_message=cont, kwargs=kw) == want
    ids = hf.apply_chat_template(msgs[:2], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    tok = Tokenizer.from_file(f"{d}/tokenizer.json")
    assert tok.encode(ours.render(msgs[:2]), add_special_tokens=False).ids == list(ids)  # one BOS


def test_chat_template_override(tmp_path):
    from wideep.launch.chat.chat_template import TemplateError, load_chat_template
    d = make_tiny_checkpoint(str(tmp_path / "m"))
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{{ strftime_now('%Y')[:0] }}")
    assert load_chat_template(d, str(f)).render([{"role": "user", "content": "x"}]) == "[user]x"
    f.write_text("{% for m in messages %}")
    with pytest.raises(TemplateError, match="does not compile"):
        load_chat_template(d, str(f))
