"""The prompt of a chat request: the checkpoint's Jinja chat template rendered as Hugging Face renders it
(jinja2's immutable sandbox, trim_blocks + lstrip_blocks, loopcontrols, and HF's globals raise_exception,
strftime_now and its `tojson` filter), or DeepSeek's Python encodings for the checkpoints that ship no
template: V3.2's (launch/chat/dsv32_encoding.py) for a DeepseekV32ForCausalLM, V4's
(launch/chat/dsv4_encoding.py) for a DeepseekV4ForCausalLM.

Where the template comes from, first found: --chat-template FILE, tokenizer_config.json `chat_template`
(a string, or HF's list of {"name", "template"}: the "default" one), chat_template.jinja. vLLM's
--tokenizer-mode deepseek_v4 (deepseek_v32) picks V4's (V3.2's) encoding whatever the checkpoint ships.

V4's reasoning-effort profile (launch/chat/dsv4_text.py) comes from the checkpoint, as SGLang reads it:
config.json `dsv4_reasoning_effort_profile` ("preview" | "official") if set, else the bundled
encoding/encoding_dsv4.py (its text, never run): one that defines REASONING_EFFORT_PROMPTS is the
DeepSeek-V4-Flash-0731 encoder ("official"); anything else, or none, is the April release's ("preview").
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(ValueError):
    """The template could not be loaded or refused the conversation (raise_exception, a Jinja error)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the request: {message}")


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template does not compile: {e}") from None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v  # AddedToken as HF serialises it


TOKENIZER_MODES = ("auto", "deepseek_v32", "deepseek_v4")   # vLLM's names for the encodings
ENCODINGS = {"DeepseekV32ForCausalLM": "dsv32", "DeepseekV4ForCausalLM": "dsv4"}


@dataclass(frozen=True)
class ChatTemplate:
    """kind: "jinja" (source set), "dsv32" or "dsv4" (DeepSeek's encodings). special: bos_token ... as the
    template sees them. effort_profile: V4's reasoning-effort profile."""
    kind: str
    source: str | None
    special: dict
    effort_profile: str = "preview"

    @property
    def call_block(self) -> str | None:
        """The DSML block name of the encoding's tool calls (None: a Jinja template's own format)."""
        return {"dsv32": "function_calls", "dsv4": "tool_calls"}.get(self.kind)

    def render(self, messages: list, *, tools: list | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        kwargs = dict(kwargs or {})
        if self.kind == "dsv4":
            from .dsv4_encoding import encode_messages as encode_v4
            # vLLM's reading: thinking unless the request turns it off
            thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking")) \
                if "thinking" in kwargs or "enable_thinking" in kwargs else True
            return encode_v4(messages, tools=tools, thinking=thinking, reasoning_effort=kwargs.get("reasoning_effort"),
                             effort_profile=self.effort_profile, continue_final_message=continue_final_message,
                             bos=self.special["bos_token"])
        if self.kind == "dsv32":
            from .dsv32_encoding import encode_messages
            return encode_messages(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, bos=self.special["bos_token"],
                                   **kwargs)
        import jinja2
        ctx = dict(self.special, **kwargs)
        ctx.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            text = _compiled(self.source).render(**ctx)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        if continue_final_message:
            text = _cut_after_final(text, messages[-1])
        return text


def _cut_after_final(text: str, last: dict) -> str:
    """As HF: the rendered text ends right after the final message's content (its end-of-turn markup cut)."""
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content)
    content = (content or "").strip()
    if not content or content not in text:
        raise TemplateError("continue_final_message: the final message's content is not in the rendered prompt")
    return text[:text.rindex(content) + len(content)]


_CACHE: dict[str, object] = {}


def _compiled(source: str):
    if source not in _CACHE:
        _CACHE[source] = compile_template(source)
    return _CACHE[source]


def effort_profile(model_dir: str) -> str:
    """V4's reasoning-effort profile of the checkpoint (module docstring)."""
    declared = _read_json(os.path.join(model_dir, "config.json")).get("dsv4_reasoning_effort_profile")
    if declared is not None:
        from .dsv4_text import PROFILES
        if declared not in PROFILES:
            raise TemplateError(f"config.json dsv4_reasoning_effort_profile must be one of {list(PROFILES)}, "
                                f"got {declared!r}")
        return declared
    path = os.path.join(model_dir, "encoding", "encoding_dsv4.py")
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            if "REASONING_EFFORT_PROMPTS" in f.read():
                return "official"
    return "preview"


def _encoding(model_dir: str, kind: str, special: dict) -> ChatTemplate:
    special["bos_token"] = special["bos_token"] or "<｜begin▁of▁sentence｜>"
    return ChatTemplate(kind, None, special, effort_profile(model_dir) if kind == "dsv4" else "preview")


def load_chat_template(model_dir: str, override: str | None = None, tokenizer_mode: str | None = None
                       ) -> ChatTemplate | None:
    """-> the checkpoint's chat template (None: it has none and no encoding applies)."""
    tc = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    special = {k: _token_text(tc.get(k)) or "" for k in SPECIAL_KEYS}
    mode = tokenizer_mode or "auto"
    if mode not in TOKENIZER_MODES:
        raise TemplateError(f"--tokenizer-mode must be one of {list(TOKENIZER_MODES)}, got {mode!r}")
    if mode != "auto":
        if override is not None:
            raise TemplateError(f"--chat-template and --tokenizer-mode {mode} both choose the prompt format: "
                                f"give one of them")
        return _encoding(model_dir, "dsv4" if mode == "deepseek_v4" else "dsv32", special)
    if override is not None:
        with open(override, encoding="utf-8") as f:
            source = f.read()
    else:
        source = tc.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(model_dir, "chat_template.jinja")
        if source is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
    if source is not None:
        _compiled(source)  # a template that does not compile fails at start-up, not per request
        return ChatTemplate("jinja", source, special)
    archs = _read_json(os.path.join(model_dir, "config.json")).get("architectures") or []
    kind = next((ENCODINGS[a] for a in archs if a in ENCODINGS), None)
    return _encoding(model_dir, kind, special) if kind else None
