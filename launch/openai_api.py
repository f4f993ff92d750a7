"""OpenAI /v1/completions request parsing and response shapes (no HTTP here; launch/server.py serves it).

Request fields: prompt (string, or a list of token ids; one prompt per request), max_tokens (16),
temperature (1.0), top_p (1.0), top_k (-1 or 0: off), seed, logprobs (N <= the engine's max_logprobs),
stream, stream_options.include_usage, model (must name the served model when given), presence_penalty,
frequency_penalty, logit_bias ({"token id": bias}), and wideep/vLLM extensions stop_token_ids, ignore_eos,
repetition_penalty, min_p, min_tokens.
Unknown fields are ignored, as OpenAI clients send many (user, ...); fields that would change the
result but are not supported (n > 1, best_of > 1, echo, stop strings, suffix, prompt_logprobs) are
rejected rather than silently ignored.
"""
from __future__ import annotations

import time
import uuid

from engine.sampling_params import CompletionOutput, SamplingParams


class BadRequest(ValueError):
    """-> HTTP `status` with {"error": {"message", "type", "code"}}."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# Fields that would change the result, accepted only at their no-op values.
UNSUPPORTED = {"suffix": (None, ""), "prompt_logprobs": (None,)}


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI sends {"token id as a string": bias}; -> {int: float} (SamplingParams clamps to +-100)."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadRequest(f"'logit_bias' must be an object {{token id: bias}}, got {v!r}")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"'logit_bias' keys must be token ids, got {k!r}") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise BadRequest(f"'logit_bias[{k}]' must be a number, got {b!r}")
        out[t] = float(b)
    return out


def _int(body: dict, name: str, default, lo: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise BadRequest(f"'{name}' must be >= {lo}, got {v}")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{name}' must be a number, got {v!r}")
    return float(v)


def _token_ids(p: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def _prompt(body: dict):
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required")
    p = body["prompt"]
    if isinstance(p, str):
        if not p:
            raise BadRequest("'prompt' is empty")
        return p
    if not isinstance(p, list):
        raise BadRequest(f"'prompt' must be a string or a list of token ids, got {type(p).__name__}")
    if not p:
        raise BadRequest("'prompt' is empty")
    if _token_ids(p):
        return p
    if len(p) == 1 and (isinstance(p[0], str) or (isinstance(p[0], list) and _token_ids(p[0]))):
        return _prompt({"prompt": p[0]})  # a batch of one, as some clients always send
    if len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise BadRequest(f"batched prompts ({len(p)}) are not supported; send one prompt per request")
    raise BadRequest("'prompt' must be a string or a list of integer token ids")


def parse_completion(body, served_model: str, aliases: tuple[str, ...] = (), defaults: dict | None = None) -> tuple:
    """body (decoded JSON) -> (prompt, SamplingParams, stream, include_usage); BadRequest on bad input.
    `model` may be served_model or one of aliases (other names of the same model). defaults: the
    checkpoint's generation_config.json values (engine.generation_defaults) for the sampling fields
    the body leaves out or sends as null, as vLLM applies them."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != served_model and model not in aliases:
        raise BadRequest(f"model {model!r} does not exist; this server serves {served_model!r}", status=404)
    prompt = _prompt(body)
    if _int(body, "n", 1) != 1 or _int(body, "best_of", 1) != 1:
        raise BadRequest("only n = 1 (and best_of = 1) is supported")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported")
    if body.get("stop"):
        raise BadRequest("stop strings are not supported; use 'stop_token_ids'")
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise BadRequest(f"'{name}' is not supported (got {body[name]!r}); leave it out")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest(f"'stop_token_ids' must be a list of integers, got {stop_ids!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest(f"'stream_options' must be an object, got {opts!r}")
    if not isinstance(opts.get("include_usage", False), bool):
        raise BadRequest(f"'stream_options.include_usage' must be true or false, got {opts['include_usage']!r}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"'ignore_eos' must be true or false, got {ignore_eos!r}")
    d = defaults or {}
    try:
        params = SamplingParams(max_tokens=_int(body, "max_tokens", 16, lo=1),
                                temperature=_num(body, "temperature", d.get("temperature", 1.0)),
                                top_p=_num(body, "top_p", d.get("top_p", 1.0)),
                                top_k=_int(body, "top_k", d.get("top_k", -1)), seed=_int(body, "seed", None),
                                logprobs=_int(body, "logprobs", None, lo=0), stop_token_ids=stop_ids,
                                ignore_eos=ignore_eos, output_kind="delta" if stream else "final_only",
                                min_tokens=_int(body, "min_tokens", 0, lo=0),
                                min_p=_num(body, "min_p", d.get("min_p", 0.0)),
                                presence_penalty=_num(body, "presence_penalty", 0.0),
                                frequency_penalty=_num(body, "frequency_penalty", 0.0),
                                repetition_penalty=_num(body, "repetition_penalty", d.get("repetition_penalty", 1.0)),
                                logit_bias=_logit_bias(body))
    except ValueError as e:  # SamplingParams' own range checks (temperature < 0, top_p outside (0, 1])
        raise BadRequest(str(e).replace("SamplingParams.", "")) from None
    return prompt, params, stream, bool(opts.get("include_usage"))


class Completion:
    """One request's response: the final body (stream false) or SSE chunks (stream true).
    decode: token id -> its text (for logprobs.tokens); "token_id:N" when there is no tokenizer."""

    def __init__(self, model: str, decode=None):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.decode = decode or (lambda t: f"token_id:{t}")
        self._offset = 0  # text_offset of the next token (characters into the completion)

    def _logprobs(self, c: CompletionOutput) -> dict | None:
        if c.logprobs is None:
            return None
        toks = [self.decode(t) for t in c.token_ids]
        offsets = []
        for s in toks:
            offsets.append(self._offset)
            self._offset += len(s)
        return {"tokens": toks, "token_logprobs": [lp.get(t) for t, lp in zip(c.token_ids, c.logprobs)],
                "top_logprobs": [self._top(lp) for lp in c.logprobs],
                "text_offset": offsets}

    def _top(self, lp: dict[int, float]) -> dict[str, float]:
        """{token text: logprob}; ids whose text collides with another's (byte tokens that all decode
        to U+FFFD) keep "token_id:N" so that no entry is lost."""
        out: dict[str, float] = {}
        for t, v in lp.items():
            s = self.decode(t)
            out[s if s not in out else f"token_id:{t}"] = v
        return out

    def _choice(self, c: CompletionOutput, finished: bool) -> dict:
        return {"index": 0, "text": c.text, "token_ids": list(c.token_ids), "logprobs": self._logprobs(c),
                "finish_reason": c.finish_reason if finished else None}

    def _envelope(self, choices: list, usage: dict | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """cached_tokens: prompt tokens the prefix cache held at admission (vLLM's prompt_tokens_details)."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def response(self, out) -> dict:
        """out: the final (cumulative or final_only) RequestOutput."""
        c = out.outputs[0]
        return self._envelope([self._choice(c, True)],
                              self.usage(len(out.prompt_token_ids), len(c.token_ids), cached_tokens(out)))

    def chunk(self, out) -> dict:
        """out: a delta RequestOutput; usage stays null (see usage_chunk)."""
        return self._envelope([self._choice(out.outputs[0], out.finished)], None)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        return self._envelope([], self.usage(prompt_tokens, completion_tokens, cached_tokens))


def cached_tokens(out) -> int:
    """A RequestOutput's prefix-cache hit tokens (its metrics' cached_tokens, set at admission)."""
    return (out.metrics or {}).get("cached_tokens", 0)
