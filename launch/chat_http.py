"""The /v1/chat/completions handler (launch/server.py routes it): the prompt from the chat template,
tokenized without special tokens added a second time, then the engine's tokens turned back into
OpenAI chat objects. The output is detokenized here with the special tokens kept, because the
reasoning split and the tool-call parsers need <think>, </think> and the tool-call markup.

Stream: a first chunk with delta {"role": "assistant", "content": ""}, then reasoning_content / content
deltas, tool calls as one tool_calls delta each once their block has ended, the finish_reason chunk,
with stream_options.include_usage a usage chunk with empty choices, then data: [DONE].
"""
from __future__ import annotations

import time

from aiohttp import web

from engine.front.async_engine import EngineDeadError

from . import reasoning, tool_parsers
from .chat import BadRequest, ChatRequest, parse_chat
from .chat_template import TemplateError
from .dsv32_encoding import EncodingError
from .http_body import _error, _sse
from .openai_api import Completion, cached_tokens, finite
from .reasoning import ReasoningSplitter, held_back
from .structured_api import ForcedToolOutput

try:   # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:   # pragma: no cover
    DecodeStream = None


class ChatOutput:
    """One choice's text as it grows: token ids in, (reasoning, content, tool calls) deltas out."""

    def __init__(self, tok, eos_ids: set[int], in_reasoning: bool, tool_parser: str | None):
        self.tok, self.eos_ids, self.tool_parser = tok, eos_ids, tool_parser
        self.ids: list[int] = []
        self.text = ""  # decoded so far (special tokens kept), without DecodeStream
        # Special tokens are kept for the parsers; with none at work they are dropped, as vLLM does.
        self.skip_special = not in_reasoning and tool_parser is None
        self.stream = DecodeStream(skip_special_tokens=self.skip_special) if DecodeStream is not None else None
        self.splitter = ReasoningSplitter(in_reasoning)
        self.marker = tool_parsers.start_marker(tool_parser) if tool_parser else None
        self.tool_buf = ""      # content from the tool-call marker on (or a marker's possible start)
        self.in_tools = False
        self.calls: list = []

    def feed(self, token_ids: list[int], final: bool) -> dict:
        """-> {"reasoning_content": str, "content": str, "tool_calls": [...]}, the new parts only."""
        new = self._decode([t for t in token_ids if t not in self.eos_ids], final)
        r, c = self.splitter.feed(new, final)
        out = {"reasoning_content": r, "content": self._content(c, final), "tool_calls": []}
        if final and self.in_tools:
            content, calls = tool_parsers.parse(self.tool_parser, self.tool_buf)
            self.calls = calls
            out["content"] += content
            out["tool_calls"] = [call.openai(i) for i, call in enumerate(calls)]
        return out

    def _decode(self, ids: list[int], final: bool) -> str:
        """The new text of ids, special tokens kept: tokenizers' incremental DecodeStream (it holds a
        character back until its bytes are complete), else a decode of everything so far."""
        self.ids += ids
        if self.stream is not None:
            return "".join(self.stream.step(self.tok, t) or "" for t in ids)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip_special)
        if not final and text.endswith("\ufffd"):  # a character whose bytes have not all arrived
            text = text[:-1]
        new, self.text = text[len(self.text):], text
        return new

    def _content(self, c: str, final: bool) -> str:
        if self.marker is None:
            return c
        if self.in_tools:
            self.tool_buf += c
            return ""
        buf = self.tool_buf + c
        i = buf.find(self.marker)
        if i >= 0:
            self.in_tools, self.tool_buf = True, buf[i:]
            return buf[:i]
        keep = 0 if final else held_back(buf, self.marker)
        self.tool_buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]


def _logprobs(decode, token_ids: list[int], lps: list[dict] | None, top: int | None) -> dict | None:
    if top is None or lps is None:
        return None

    def entry(t, v):
        s = decode(t)
        return {"token": s, "logprob": finite(v), "bytes": list(s.encode("utf-8", "surrogatepass"))}

    content = []
    for t, lp in zip(token_ids, lps):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append(dict(entry(t, lp.get(t)), top_logprobs=[entry(k, v) for k, v in best]))
    return {"content": content}


class ChatHandler:
    """Bound to a Server (its engine, model names, body reading) and the chat options of the run."""

    def __init__(self, server, template, reasoning_parser: str | None, tool_parser: str | None, auto_tools: bool):
        self.server, self.template = server, template
        self.reasoning_parser, self.tool_parser, self.auto_tools = reasoning_parser, tool_parser, auto_tools
        tok = server.aengine.engine.core.tokenizer
        self.tok = tok
        # The end-of-sequence token ends the output; it is no part of the answer's text.
        eos = {"<｜end▁of▁sentence｜>", (template.special.get("eos_token") if template else None) or ""}
        self.eos_ids = {tok.token_to_id(s) for s in eos if s} - {None} if tok is not None else set()

    def messages_ids(self, body: dict) -> list[int]:
        """vLLM's chat form of /tokenize: the prompt ids this endpoint would run for the same messages,
        tools, add_generation_prompt, continue_final_message and chat_template_kwargs."""
        if self.tok is None:
            raise BadRequest("chat needs the checkpoint's tokenizer.json")
        req = parse_chat({k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs")},
                         self.server.model_name, self.server.aliases, auto_tools=self.auto_tools)
        return self.prompt(req)[1]

    def prompt(self, req: ChatRequest) -> tuple[str, list[int]]:
        if self.template is None:
            raise BadRequest("this model has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja); start the server with --chat-template FILE")
        try:
            text = self.template.render(req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message, kwargs=req.template_kwargs)
        except (TemplateError, EncodingError) as e:
            raise BadRequest(str(e)) from None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # "\udcff" is valid JSON, but no text: nothing can tokenize it
            raise BadRequest(f"the messages contain text that is not valid Unicode (an unpaired UTF-16 "
                             f"surrogate {text[e.start]!r}); send valid UTF-8 text") from None
        # The template wrote the BOS itself: encoding must not add it a second time.
        return text, self.tok.encode(text, add_special_tokens=False).ids

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        body = await self.server.read_json(request)
        if isinstance(body, web.Response):
            return body
        try:
            if self.tok is None:
                raise BadRequest("chat needs the checkpoint's tokenizer.json")
            req = parse_chat(body, self.server.model_name, self.server.aliases, auto_tools=self.auto_tools,
                             defaults=self.server.defaults)
            text, ids = self.prompt(req)
        except BadRequest as e:
            return _error(e.status, str(e))
        if not ids:
            return _error(400, "the chat template rendered an empty prompt")
        rid = self.server.request_ids.assign(request, "chatcmpl")   # X-Request-Id, echoed by the server
        created, model = int(time.time()), self.server.model_name
        in_reasoning = reasoning.starts_in_reasoning(self.reasoning_parser, text, req.template_kwargs)
        out = (ForcedToolOutput(self.tok, self.eos_ids, req.forced_tool) if req.forced_tool else
               ChatOutput(self.tok, self.eos_ids, in_reasoning, self.tool_parser if req.parse_tools else None))
        decode = lambda t: self.tok.decode([t], skip_special_tokens=False)  # noqa: E731
        try:
            gen = self.server.aengine.generate(ids, req.params, request_id=rid)
        except BaseException:
            self.server.request_ids.release(rid)
            raise
        env = {"id": rid, "created": created, "model": model}
        try:
            try:
                first = await gen.__anext__()
            except ValueError as e:
                return _error(400, str(e))
            except EngineDeadError as e:
                return _error(503, str(e))
            if not req.stream:
                last = first
                async for last in gen:
                    pass
                c = last.outputs[0]
                d = out.feed(list(c.token_ids), final=True)
                # Whitespace before a tool-call block (DSML's "\n\n") is no answer.
                msg = {"role": "assistant", "content": None if out.calls and not d["content"].strip() else d["content"]}
                if in_reasoning or d["reasoning_content"]:
                    msg["reasoning_content"] = msg["reasoning"] = d["reasoning_content"]
                msg["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in d["tool_calls"]]
                finish = "tool_calls" if out.calls and c.finish_reason == "stop" else c.finish_reason
                choice = {"index": 0, "message": msg, "logprobs": _logprobs(decode, c.token_ids, c.logprobs, req.top_logprobs),
                          "finish_reason": finish}
                n_prompt = len(last.prompt_token_ids)
                return web.json_response(dict(env, object="chat.completion", choices=[choice],
                                              usage=Completion.usage(n_prompt, len(c.token_ids), cached_tokens(last))))
            return await self._stream(request, req, env, gen, first, out, decode, _sse)
        finally:
            await gen.aclose()
            self.server.request_ids.release(rid)

    async def _stream(self, request, req: ChatRequest, env: dict, gen, res, out: ChatOutput, decode, _sse):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(delta: dict, finish=None, logprobs=None) -> bytes:
            return _sse(dict(env, object="chat.completion.chunk", **usage_field,
                             choices=[{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]))

        await resp.write(chunk({"role": "assistant", "content": ""}))
        n = 0
        finish = None
        try:
            while True:
                c = res.outputs[0]
                n += len(c.token_ids)
                d = out.feed(list(c.token_ids), final=res.finished)
                delta = {k: v for k, v in d.items() if v}
                lp = _logprobs(decode, c.token_ids, c.logprobs, req.top_logprobs)
                if res.finished:
                    finish = "tool_calls" if out.calls and c.finish_reason == "stop" else c.finish_reason
                if delta or lp or res.finished:
                    if "reasoning_content" in delta:
                        delta["reasoning"] = delta["reasoning_content"]
                    await resp.write(chunk(delta, finish, lp))
                if res.finished:
                    break
                res = await gen.__anext__()
        except EngineDeadError as e:  # the 200 is already sent: report in-band, then end the stream
            await resp.write(_sse({"error": {"message": str(e), "type": "server_error", "code": 503}}))
        if req.include_usage:
            await resp.write(_sse(dict(env, object="chat.completion.chunk", choices=[],
                                       usage=Completion.usage(len(res.prompt_token_ids), n, cached_tokens(res)))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


OPTIONS = ("chat_template", "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice")


def make_handler(server, chat_template: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> ChatHandler:
    """The [server] chat options (OPTIONS) -> the handler; the template is loaded (and compiled) here,
    so a broken --chat-template fails at start-up."""
    from .chat_template import load_chat_template
    if reasoning_parser not in (None, *reasoning.PARSERS):
        raise ValueError(f"--reasoning-parser {reasoning_parser!r}: one of {list(reasoning.PARSERS)}")
    if tool_call_parser not in (None, *tool_parsers.PARSERS):
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: one of {list(tool_parsers.PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    template = load_chat_template(server.aengine.engine.core.model_dir, chat_template)
    return ChatHandler(server, template, reasoning_parser, tool_call_parser, enable_auto_tool_choice)
