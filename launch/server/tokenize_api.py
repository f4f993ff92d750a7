"""vLLM's /tokenize and /detokenize bodies (no HTTP here; launch/server/app.py serves them).

    POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false, "model"?}
                      -> {"count": n, "max_model_len": m, "tokens": [ids], "token_strs": [str] | null}
    POST /detokenize  {"tokens": [ids], "model"?} -> {"prompt": str}

tokenizer: a `tokenizers.Tokenizer` (the checkpoint's tokenizer.json). The chat form of /tokenize
({"messages": [...], "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
"tools"}) gives the ids the chat endpoint would run (messages_ids: its template, no second BOS).
"""
from __future__ import annotations

from .openai_api import BadRequest, _bool


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def tokenize(body, tokenizer, max_model_len: int, messages_ids=None) -> dict:
    """messages_ids(body) -> ids: the chat endpoint's rendering, for the chat form."""
    body = _object(body)
    want_strs = _bool(body, "return_token_strs", False)
    if "messages" in body:
        if messages_ids is None:
            raise BadRequest("'messages' needs the chat endpoint; send 'prompt' (text)")
        ids = messages_ids(body)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": [tokenizer.id_to_token(t) for t in ids] if want_strs else None}
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest(f"'prompt' must be a string, got {type(prompt).__name__}")
    add_special = _bool(body, "add_special_tokens", True)
    enc = tokenizer.encode(prompt, add_special_tokens=add_special)
    return {"count": len(enc.ids), "max_model_len": max_model_len, "tokens": list(enc.ids),
            "token_strs": list(enc.tokens) if want_strs else None}


def detokenize(body, tokenizer) -> dict:
    body = _object(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"'tokens' must be a list of integer token ids, got {type(ids).__name__}")
    V = tokenizer.get_vocab_size(with_added_tokens=True)
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise BadRequest(f"'tokens': token id {bad[0]} is out of range [0, {V})")
    # transformers' decode default (vLLM's): special tokens are kept in the text
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
