"""The server's tokenizer routes, in vLLM's shapes (what lm-evaluation-harness's "remote"
tokenizer backend and other clients of OpenAI-compatible servers call):

- `GET /tokenizer_info`: the special tokens, the chat template and the context;
- `POST /tokenize`: `{"prompt": str, "add_special_tokens": bool = true}` or `{"messages": [...],
  "add_generation_prompt": bool = true, "chat_template_kwargs": {...}}` -> `{"tokens", "count",
  "max_model_len"}`;
- `POST /detokenize`: `{"tokens": [ids]}` -> `{"prompt": str}`.

Pure functions over a loaded `Pair` and a parsed body; the server runs them off its event loop.
Bad bodies raise `APIError` (400, naming the field), as the completion routes do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .chat_template import template_variables
from .errors import FieldError, InputError
from .openai_api import APIError, messages_field
from .pair import Pair

__all__ = ["detokenize", "tokenize", "tokenizer_info"]

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}': expected true or false", param=name)
    return value


def tokenizer_info(pair: Pair, context: int) -> dict[str, Any]:
    """The special tokens (text), the chat template source and the context length."""
    manifest, tok = pair.manifest, pair.tokenizer
    pad = manifest.pad_token_id
    return {"eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": None if pad is None else tok.decode([pad], skip_special_tokens=False),
            "chat_template": tok.chat_template, "model_max_length": context,
            "vocab_size": manifest.vocab_size, "eos_token_ids": list(manifest.eos_token_ids)}


def tokenize(pair: Pair, body: Any, context: int,
             variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The token ids of `body`'s prompt text or chat messages (rendered by the pair's template,
    with the server's template `variables` and the body's `chat_template_kwargs` over them, as
    the chat route renders them).

    Raises:
        APIError: 400 for a body that has neither (or both), or that the template refuses.
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise APIError(400, "give 'prompt' (text) or 'messages' (a chat), one of the two",
                       param="prompt")
    try:
        if has_prompt:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt': expected a string", param="prompt")
            ids = pair.tokenizer.encode(prompt, add_special_tokens=_flag(
                body, "add_special_tokens", True))
        else:
            ids = pair.tokenizer.encode_chat(
                messages_field(body.get("messages")),
                add_generation_prompt=_flag(body, "add_generation_prompt", True),
                variables={**(variables or {}),
                           **template_variables(body.get("chat_template_kwargs"))})
    except FieldError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except InputError as exc:
        raise APIError(400, str(exc), param="messages" if has_messages else "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": context}


def detokenize(pair: Pair, body: Any) -> dict[str, Any]:
    """The text of `body`'s token ids, special tokens included.

    Raises:
        APIError: 400 for ids that are not a list of integers in the vocabulary.
    """
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = pair.manifest.vocab_size
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise APIError(400, f"'tokens': expected a list of token ids in [0, {vocab})",
                       param="tokens")
    return {"prompt": pair.tokenizer.decode(tokens, skip_special_tokens=False)}
