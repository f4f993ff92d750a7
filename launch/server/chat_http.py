"""The /v1/chat/completions handler (launch/server/app.py routes it): the prompt from the chat template,
tokenized without special tokens added a second time, then the engine's output turned back into
OpenAI chat objects (launch/chat/output.py). The engine's front detokenizes (one detokenizer for both
endpoints, so stop strings are cut and held back the same way) with the request's skip_special_tokens; only
where the tool-call parser's markup is special tokens of this tokenizer does it keep them, and the chat output
takes them out again. The reasoning split finds </think> by token id. n > 1: one ChatOutput per choice.

Stream: per choice a first chunk with delta {"role": "assistant", "content": ""}, then
reasoning_content / content deltas, each tool call as a tool_calls delta once it is complete and
parses, the finish_reason chunk; with stream_options.include_usage a usage chunk with empty choices,
then data: [DONE].
"""
from __future__ import annotations

import dataclasses
import time

from aiohttp import web

from wideep.engine.front.async_engine import EngineDeadError

from wideep.structured.backend import special_token_ids

from ..chat import reasoning, tool_parsers
from ..chat.chat_template import TemplateError
from ..chat.dsv32_encoding import EncodingError
from ..chat.output import ChatOutput, OutputFormat
from .chat_api import BadRequest, ChatRequest, parse_chat
from .http_body import _error, _sse
from .openai_api import Completion, cached_tokens, finite


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
        self.tok = tok = server.aengine.engine.core.tokenizer
        self.call_block = template.call_block if template is not None else None
        self.specials = sorted(tok.id_to_token(i) for i in special_token_ids(tok)) if tok is not None else []
        ids = {t: tok.token_to_id(t) if tok is not None else None for t in (reasoning.THINK, reasoning.END_THINK)}
        self.think_id, self.end_id = ids[reasoning.THINK], ids[reasoning.END_THINK]
        self._special_markup: dict[str, bool] = {}

    def _parse(self, body: dict, defaults: dict | None = None) -> ChatRequest:
        return parse_chat(body, self.server.model_name, self.server.aliases, auto_tools=self.auto_tools,
                          defaults=defaults, call_block=self.call_block)

    def _markup_special(self, parser: str) -> bool:
        """Is any of the parser's markup a special token of this tokenizer (dropped by skip_special_tokens)?"""
        if parser not in self._special_markup:
            ids = {self.tok.token_to_id(s) for s in tool_parsers.markup_tokens(parser)} - {None}
            self._special_markup[parser] = bool(ids & special_token_ids(self.tok))
        return self._special_markup[parser]

    def output_format(self, req: ChatRequest, prompt: str) -> tuple[object, OutputFormat]:
        """-> (the engine's SamplingParams, how the choices' output is read)."""
        params, forced = req.params, req.forced_tool
        in_reasoning = reasoning.starts_in_reasoning(self.reasoning_parser, prompt, req.template_kwargs)
        if forced:   # constrained: the encoding's own DSML calls, or JSON
            parser = {"function_calls": "deepseek_v32", "tool_calls": "deepseek_v4"}.get(self.call_block)
        else:
            parser = self.tool_parser if req.parse_tools else None
        keep = parser is not None and self._markup_special(parser)
        front_skip = params.skip_special_tokens and not keep
        so = params.structured_outputs
        if so is not None and in_reasoning and self.end_id is not None:   # the answer is constrained, not the reasoning
            so = dataclasses.replace(so, after_token=self.end_id)
        params = dataclasses.replace(params, skip_special_tokens=front_skip, structured_outputs=so)
        stripped = front_skip != req.params.skip_special_tokens   # kept for the parser only: taken out again
        fmt = OutputFormat(in_reasoning=in_reasoning, tool_parser=parser,
                           decode=lambda ids: self.tok.decode(ids, skip_special_tokens=front_skip),
                           think_id=self.think_id, end_id=self.end_id, strip=tuple(self.specials) if stripped else (),
                           max_calls=None if req.parallel_tool_calls else 1,
                           forced_json=forced if forced and parser is None else None)
        return params, fmt

    def messages_ids(self, body: dict) -> list[int]:
        """vLLM's chat form of /tokenize: the prompt ids this endpoint would run for the same messages,
        tools, add_generation_prompt, continue_final_message and chat_template_kwargs."""
        if self.tok is None:
            raise BadRequest("chat needs the checkpoint's tokenizer.json")
        req = self._parse({k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs")})
        return self.prompt(req)[1]

    def prompt(self, req: ChatRequest) -> tuple[str, list[int]]:
        if self.template is None:
            raise BadRequest("this model has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja); start the server with --chat-template FILE, or --tokenizer-mode "
                             "deepseek_v4 / deepseek_v32 for DeepSeek's encodings")
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
            req = self._parse(body, self.server.defaults)
            text, ids = self.prompt(req)
        except BadRequest as e:
            return _error(e.status, str(e))
        if not ids:
            return _error(400, "the chat template rendered an empty prompt")
        rid = self.server.request_ids.assign(request, "chatcmpl")   # X-Request-Id, echoed by the server
        created, model = int(time.time()), self.server.model_name
        params, fmt = self.output_format(req, text)
        outs = {i: ChatOutput(fmt) for i in range(params.n)}
        decode = lambda t: self.tok.decode([t], skip_special_tokens=False)  # noqa: E731
        try:
            gen = self.server.aengine.generate(ids, params, request_id=rid)
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
                choices = [self._choice(outs[c.index], c, fmt.in_reasoning, req.top_logprobs, decode)
                           for c in last.outputs]
                n_out = sum(len(c.token_ids) for c in last.outputs)
                return web.json_response(dict(env, object="chat.completion", choices=choices,
                                              usage=Completion.usage(len(last.prompt_token_ids), n_out,
                                                                     cached_tokens(last))))
            return await self._stream(request, req, env, gen, first, outs, decode)
        finally:
            await gen.aclose()
            self.server.request_ids.release(rid)

    def _choice(self, out: ChatOutput, c, in_reasoning: bool, top: int | None, decode) -> dict:
        """A finished CompletionOutput -> its chat.completion choice."""
        d = out.feed(c.text, c.token_ids, final=True)
        # No answer after the reasoning (it never ended), or only calls: content null, as vLLM.
        content = None if not out.ended_reasoning or (out.calls and not d["content"].strip()) else d["content"]
        msg = {"role": "assistant", "content": content}
        if in_reasoning or d["reasoning_content"]:
            msg["reasoning_content"] = msg["reasoning"] = d["reasoning_content"]
        msg["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in d["tool_calls"]]
        return {"index": c.index, "message": msg, "logprobs": _logprobs(decode, c.token_ids, c.logprobs, top),
                "finish_reason": _finish(out, c), "stop_reason": c.stop_reason}

    async def _stream(self, request, req: ChatRequest, env: dict, gen, res, outs: dict, decode):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        usage_field = {"usage": None} if req.include_usage else {}

        def chunk(index: int, delta: dict, finish=None, logprobs=None, stop_reason=None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            return _sse(dict(env, object="chat.completion.chunk", **usage_field, choices=[choice]))

        for i in outs:
            await resp.write(chunk(i, {"role": "assistant", "content": ""}))
        n = 0
        try:
            while True:
                for c in res.outputs:
                    out, done = outs[c.index], c.finish_reason is not None
                    n += len(c.token_ids)
                    d = out.feed(c.text, c.token_ids, final=done)
                    delta = {k: v for k, v in d.items() if v}
                    lp = _logprobs(decode, c.token_ids, c.logprobs, req.top_logprobs)
                    if delta or lp or done:
                        if "reasoning_content" in delta:
                            delta["reasoning"] = delta["reasoning_content"]
                        await resp.write(chunk(c.index, delta, _finish(out, c) if done else None, lp, c.stop_reason))
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


def _finish(out: ChatOutput, c) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if out.calls and c.finish_reason == "stop" else c.finish_reason


OPTIONS = ("chat_template", "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice", "tokenizer_mode")


def make_handler(server, chat_template: str | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 tokenizer_mode: str | None = None) -> ChatHandler:
    """The [server] chat options (OPTIONS) -> the handler; the template is loaded (and compiled) here,
    so a broken --chat-template fails at start-up."""
    from ..chat.chat_template import load_chat_template
    if reasoning_parser not in (None, *reasoning.PARSERS):
        raise ValueError(f"--reasoning-parser {reasoning_parser!r}: one of {list(reasoning.PARSERS)}")
    if tool_call_parser not in (None, *tool_parsers.PARSERS):
        raise ValueError(f"--tool-call-parser {tool_call_parser!r}: one of {list(tool_parsers.PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    template = load_chat_template(server.aengine.engine.core.model_dir, chat_template, tokenizer_mode)
    return ChatHandler(server, template, reasoning_parser, tool_call_parser, enable_auto_tool_choice)
