"""The chat pieces on scripted text (random weights never write this markup): the reasoning split
streamed chunk by chunk equals the whole split, tool calls of each DeepSeek format parse (and a
malformed block stays text; two calls stream one at a time), DeepSeek-V3.2's encoding, and
ChatOutput on the front's text."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from wideep.launch.chat import reasoning, tool_parsers
from wideep.launch.chat.dsv32_encoding import encode_messages
from wideep.launch.server.chat_http import ChatOutput
from wideep.launch.tiny.checkpoint import make_tiny_checkpoint

V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
V32 = ('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
       'Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')


@pytest.mark.parametrize("text", ["abc</think>answer", "<think>\nabc</think>answer", "no end", "</think>x"])
def test_reasoning_stream_equals_whole(text):
    whole = reasoning.split(text, True)
    for size in (1, 2, 3):
        s, r, c = reasoning.ReasoningSplitter(True), "", ""
        for i in range(0, len(text), size):
            dr, dc = s.feed(text[i:i + size], final=i + size >= len(text))
            r, c = r + dr, c + dc
        assert (r, c) == (whole[0], whole[1])
    assert reasoning.split("abc</think>answer", True) == ("abc", "answer")
    assert reasoning.split("x", False) == (None, "x")


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
    out, seen = ChatOutput(False, parser), []
    for i, ch in enumerate(two):
        d = out.feed(ch, final=i == len(two) - 1)
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


def test_chat_output_on_the_fronts_text(tmp_path):
    """The chat output reads the front's text deltas (special tokens kept, the ending EOS left out
    by the front), token by token, a multi-byte character split across tokens included."""
    from wideep.engine.front.outputs import RequestState
    from wideep.engine.sampling_params import SamplingParams
    from wideep.engine.worker.messages import Delta
    d = make_tiny_checkpoint(str(tmp_path), chat_template_style="r1")
    tok = Tokenizer.from_file(f"{d}/tokenizer.json")
    ids = tok.encode("hmm é</think>Sure." + V3, add_special_tokens=False).ids + [tok.token_to_id(tool_parsers.EOS)]
    st = RequestState("r", None, [1], SamplingParams(skip_special_tokens=False, output_kind="delta"), 4096, 0,
                      eos_token_ids=(ids[-1],))
    out, got = ChatOutput(True, "deepseek_v3"), {"reasoning_content": "", "content": "", "tool_calls": []}
    for i, t in enumerate(ids):
        st.apply(Delta("r", [t], None, 0.0, "stop" if i == len(ids) - 1 else None))
        d = out.feed(st.output(tok, delta=True).outputs[0].text, final=st.finished)
        for k in got:
            got[k] += d[k]
    assert got["reasoning_content"] == "hmm é" and got["content"] == "Sure."
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather"]
    assert tool_parsers.EOS not in st.text   # the stop token that ended it is no text


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
