"""OpenAI /v1/completions request parsing and response shapes (no HTTP here; launch/server/app.py serves it).

Request fields: prompt (a string, a list of token ids, or a batch: a list of either — one choice
per prompt and sample, index = prompt * n + sample, as OpenAI orders them), max_tokens (16; 0 only
with echo), temperature (1.0), top_p (1.0), top_k (-1 or 0: off), seed, n (samples per prompt),
stop (a string or a list), logprobs (N <= the engine's max_logprobs), echo (the prompt text prepended;
with logprobs, the prompt's token logprobs too, the first null), stream, stream_options.include_usage,
model (must name the served model when given), presence_penalty, frequency_penalty, logit_bias
({"token id": bias}), and wideep/vLLM extensions stop_token_ids, ignore_eos, include_stop_str_in_output,
skip_special_tokens, repetition_penalty, min_p, min_tokens; structured outputs (response_format,
structured_outputs: launch/server/structured_api.py). Choices carry vLLM's stop_reason (the matched stop
string or stop token id). Sampling fields left out take the checkpoint's generation_config.json
defaults.
Unknown fields are ignored, as OpenAI clients send many (user, ...); fields that would change the
result but are not supported (best_of > 1, suffix, prompt_logprobs) are rejected rather than
silently ignored.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from wideep.engine.sampling_params import CompletionOutput, SamplingParams

from .errors import BadRequest
from .structured_api import structured_of

MAX_PROMPTS = 256   # prompts in one batched request
MAX_CHOICES = 1024  # prompts x n: the sequences one request may start


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


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {v!r}")
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


def _one_prompt(p, where: str):
    if isinstance(p, str):
        if not p:
            raise BadRequest(f"{where} is empty")
        return p
    if isinstance(p, list) and p and _token_ids(p):
        return p
    if isinstance(p, list) and not p:
        raise BadRequest(f"{where} is empty")
    raise BadRequest(f"{where} must be a string or a list of integer token ids")


def _prompts(body: dict) -> list:
    """-> the prompts: one, or a batch (a list of strings or of token-id lists)."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required")
    p = body["prompt"]
    if not isinstance(p, (str, list)):
        raise BadRequest(f"'prompt' must be a string or a list of token ids, got {type(p).__name__}")
    if isinstance(p, str) or not p or _token_ids(p):
        return [_one_prompt(p, "'prompt'")]
    if len(p) > MAX_PROMPTS:
        raise BadRequest(f"'prompt' has {len(p)} prompts; at most {MAX_PROMPTS} in one request")
    return [_one_prompt(q, f"'prompt[{i}]'") for i, q in enumerate(p)]


def _stop(body: dict):
    stop = body.get("stop")
    if stop is None or stop == [] or stop == "":
        return None
    if isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return stop
    raise BadRequest(f"'stop' must be a string or a list of strings, got {type(stop).__name__}")


@dataclass
class CompletionRequest:
    prompts: list                  # each a string or a list of token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    drop_output: bool = False      # max_tokens 0 (with echo): one token is generated, none returned


def parse_completion(body, served_model: str, aliases: tuple[str, ...] = (),
                     defaults: dict | None = None) -> CompletionRequest:
    """body (decoded JSON) -> CompletionRequest; BadRequest on bad input.
    `model` may be served_model or one of aliases (other names of the same model). defaults: the
    checkpoint's generation_config.json values (engine.generation_defaults) for the sampling fields
    the body leaves out or sends as null, as vLLM applies them."""
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and model != served_model and model not in aliases:
        raise BadRequest(f"model {model!r} does not exist; this server serves {served_model!r}", status=404)
    prompts = _prompts(body)
    n = _int(body, "n", 1, lo=1)
    if _int(body, "best_of", n) != n:
        raise BadRequest("'best_of' is not supported (leave it out, or equal to n)")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest(f"'echo' must be true or false, got {echo!r}")
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
    flags = {}
    for name, default in (("ignore_eos", False), ("include_stop_str_in_output", False), ("skip_special_tokens", True)):
        flags[name] = body.get(name, default)
        if not isinstance(flags[name], bool):
            raise BadRequest(f"'{name}' must be true or false, got {flags[name]!r}")
    max_tokens = _int(body, "max_tokens", 16, lo=0 if echo else 1)
    logprobs = _int(body, "logprobs", None, lo=0)
    d = defaults or {}
    try:
        params = SamplingParams(n=n, max_tokens=max(max_tokens, 1),
                                temperature=_num(body, "temperature", d.get("temperature", 1.0)),
                                top_p=_num(body, "top_p", d.get("top_p", 1.0)),
                                top_k=_int(body, "top_k", d.get("top_k", -1)), seed=_int(body, "seed", None),
                                logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                                stop_token_ids=stop_ids, stop=_stop(body), **flags,
                                output_kind="delta" if stream else "final_only",
                                min_tokens=_int(body, "min_tokens", 0, lo=0),
                                min_p=_num(body, "min_p", d.get("min_p", 0.0)),
                                presence_penalty=_num(body, "presence_penalty", 0.0),
                                frequency_penalty=_num(body, "frequency_penalty", 0.0),
                                repetition_penalty=_num(body, "repetition_penalty", d.get("repetition_penalty", 1.0)),
                                logit_bias=_logit_bias(body), structured_outputs=structured_of(body))
    except ValueError as e:  # SamplingParams' own range checks (temperature < 0, top_p outside (0, 1])
        raise BadRequest(str(e).replace("SamplingParams.", "")) from None
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most {MAX_CHOICES}")
    return CompletionRequest(prompts, params, stream, bool(opts.get("include_usage")), echo, max_tokens == 0)


class Completion:
    """One request's response: the final body (stream false) or SSE chunks (stream true).
    decode: token id -> its text (for logprobs.tokens); "token_id:N" when there is no tokenizer.
    decode_ids: token ids -> text (an echoed prompt given as ids). n: samples per prompt."""

    def __init__(self, model: str, decode=None, decode_ids=None, n: int = 1, echo: bool = False,
                 drop_output: bool = False):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.decode = decode or (lambda t: f"token_id:{t}")
        self.decode_ids = decode_ids or (lambda ids: "")
        self.n, self.echo, self.drop_output = n, echo, drop_output
        self._offset: dict[int, int] = {}  # choice index -> text_offset of its next token
        self._echoed: set[int] = set()     # choices whose prompt was sent (streaming)

    def _logprobs(self, index: int, token_ids: list[int], lps: list | None, first_null: bool = False) -> dict | None:
        """OpenAI's completions logprobs; first_null: an echoed prompt, whose first token has none."""
        if lps is None:
            return None
        toks = [self.decode(t) for t in token_ids]
        offsets = []
        for s in toks:
            offsets.append(self._offset.get(index, 0))
            self._offset[index] = offsets[-1] + len(s)
        token_lps = [finite(lp.get(t)) if lp is not None else None for t, lp in zip(token_ids, lps)]
        top = [self._top(lp) if lp is not None else None for lp in lps]
        if first_null and token_lps:
            token_lps[0] = top[0] = None
        return {"tokens": toks, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}

    def _top(self, lp: dict[int, float]) -> dict[str, float]:
        """{token text: logprob}; ids whose text collides with another's (byte tokens that all decode
        to U+FFFD) keep "token_id:N" so that no entry is lost."""
        out: dict[str, float] = {}
        for t, v in lp.items():
            s = self.decode(t)
            out[s if s not in out else f"token_id:{t}"] = finite(v)
        return out

    def _choice(self, out, c: CompletionOutput, prompt_index: int, finished: bool) -> dict:
        index = prompt_index * self.n + c.index
        text, ids, lps = c.text, list(c.token_ids), c.logprobs
        if self.drop_output:
            text, ids, lps = "", [], [] if lps is not None else None
        logprobs = None
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            prompt_ids = list(out.prompt_token_ids)
            prompt_text = out.prompt if out.prompt is not None else self.decode_ids(prompt_ids)
            if lps is not None:
                plps = list(out.prompt_logprobs or [None] * len(prompt_ids))
                logprobs = self._logprobs(index, prompt_ids, plps, first_null=True)
            text, ids = prompt_text + text, prompt_ids + ids
        if lps is not None:
            gen = self._logprobs(index, list(c.token_ids) if not self.drop_output else [], lps)
            logprobs = gen if logprobs is None else {k: logprobs[k] + gen[k] for k in logprobs}
        return {"index": index, "text": text, "token_ids": ids, "logprobs": logprobs,
                "finish_reason": c.finish_reason if finished else None,
                "stop_reason": c.stop_reason if finished else None}

    def _envelope(self, choices: list, usage: dict | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """cached_tokens: prompt tokens the prefix cache held at admission (vLLM's prompt_tokens_details)."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def completion_tokens(self, out) -> int:
        return 0 if self.drop_output else sum(len(c.token_ids) for c in out.outputs)

    def response(self, outs: list) -> dict:
        """outs: each prompt's final (cumulative or final_only) RequestOutput, in prompt order."""
        choices = [self._choice(out, c, i, True) for i, out in enumerate(outs) for c in out.outputs]
        choices.sort(key=lambda ch: ch["index"])
        return self._envelope(choices, self.usage(sum(len(o.prompt_token_ids) for o in outs),
                                                  sum(self.completion_tokens(o) for o in outs),
                                                  sum(cached_tokens(o) for o in outs)))

    def chunk(self, out, prompt_index: int = 0) -> dict:
        """out: a delta RequestOutput of prompt `prompt_index`; usage stays null (see usage_chunk).
        A sample's finish_reason comes with its last delta (its RequestOutput is finished only once
        every sample is)."""
        return self._envelope([self._choice(out, c, prompt_index, c.finish_reason is not None)
                               for c in out.outputs], None)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        return self._envelope([], self.usage(prompt_tokens, completion_tokens, cached_tokens))


def finite(logprob: float | None) -> float | None:
    """JSON has no -Infinity: a token the grammar refused (structured outputs' logprobs are of the
    constrained distribution) is reported at -9999.0, as vLLM does."""
    return logprob if logprob is None or logprob > -9999.0 else -9999.0


def cached_tokens(out) -> int:
    """A RequestOutput's prefix-cache hit tokens (its metrics' cached_tokens, set at admission)."""
    return (out.metrics or {}).get("cached_tokens", 0)
