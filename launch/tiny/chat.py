"""The tiny checkpoints' chat side: DeepSeek's special tokens and chat templates in the shapes of
DeepSeek-V3 (answers directly), R1 (the generation prompt opens <think>) and V3.1 (thinking on with
chat_template_kwargs {"thinking": true}, else the prompt closes </think>). Templates written here in
those shapes (not copies): system first, tools listed in the system prompt, tool calls in V3 / V3.1
markup, tool results as <｜tool▁output▁begin｜>...<｜tool▁output▁end｜>.
"""
from __future__ import annotations

USER, ASSISTANT, EOS_T = "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
SPECIALS = (USER, ASSISTANT, "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
STYLES = ("v3", "r1", "v31")

_CALL = {
    "v3": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c['function']['name'] }}\\n```json\\n"
          "{{ c['function']['arguments'] if c['function']['arguments'] is string else c['function']['arguments'] | tojson }}"
          "\\n```<｜tool▁call▁end｜>",
    "v31": "<｜tool▁call▁begin｜>{{ c['function']['name'] }}<｜tool▁sep｜>"
           "{{ c['function']['arguments'] if c['function']['arguments'] is string else c['function']['arguments'] | tojson }}"
           "<｜tool▁call▁end｜>",
}
_OPEN = {"v3": ASSISTANT, "r1": ASSISTANT + "<think>\\n",
         "v31": ASSISTANT + "{% if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}"}


def chat_template(style: str) -> str:
    if style not in STYLES:
        raise ValueError(f"chat template style {style!r} is not one of {list(STYLES)}")
    call = _CALL["v3" if style == "r1" else style]
    return (
        "{{ bos_token }}"
        "{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
        "{% if tools %}\\n\\n## Tools\\n{% for t in tools %}{{ t | tojson }}\\n{% endfor %}{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %}" + (ASSISTANT + "</think>" if style == "v31" else ASSISTANT) +
        "{% if m['content'] %}{{ m['content'] }}{% endif %}"
        "{% if m['tool_calls'] %}<｜tool▁calls▁begin｜>{% for c in m['tool_calls'] %}" + call +
        "{% endfor %}<｜tool▁calls▁end｜>{% endif %}" + EOS_T +
        "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
        "{% elif m['role'] != 'system' %}{{ raise_exception('unknown role ' + m['role']) }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}" + _OPEN[style] + "{% endif %}"
    ).replace("\\n", "\n")
