"""The `logprobs` objects of OpenAI's two completion APIs (`runtime/openai_api` parses the
requests): chat's `content` list of `{token, logprob, bytes, top_logprobs}`, and the legacy
completions' parallel lists `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`, with
an echoed prompt's first. Pure functions over `TokenLogprob`s and a token's bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .logprobs import TokenLogprob

__all__ = ["echo_logprobs_json", "join_logprobs_json", "logprobs_json"]


def logprobs_json(kind: str, entries: Sequence[TokenLogprob],
                  token_bytes: Callable[[int], bytes], *, before: bytes = b"") -> dict[str, Any]:
    """A choice's `logprobs` object for `entries` (one per generated token, in order).

    Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal"}`.
    Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
    `top_logprobs` dict also holds the chosen token (as OpenAI's legacy API does) and
    `text_offset` counts characters after `before`, the completion's bytes already sent.
    `token_bytes` gives a token's bytes (`Tokenizer.token_bytes`); a token that holds part of
    a UTF-8 character shows it as U+FFFD in `token`, whole in `bytes`.
    """
    def text(token: int) -> str:
        return token_bytes(token).decode("utf-8", errors="replace")

    if kind == "chat":
        def item(token: int, logprob: float) -> dict[str, Any]:
            raw = token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                    "bytes": list(raw)}

        return {"content": [{**item(e.token, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    offsets, done = [], bytearray(before)
    for e in entries:
        offsets.append(len(done.decode("utf-8", errors="ignore")))
        done += token_bytes(e.token)
    return {"tokens": [text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in (*e.top, (e.token, e.logprob))}
                             for e in entries],
            "text_offset": offsets}


def echo_logprobs_json(prompt_ids: Sequence[int], entries: Sequence[TokenLogprob],
                       token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """The completions `logprobs` object of an echoed prompt: its first token has no logprob
    (null, as OpenAI's legacy API); `entries` are the others' (`Pair.prompt_logprobs`)."""
    first = token_bytes(prompt_ids[0])
    rest = logprobs_json("text", entries, token_bytes, before=first)
    return {"tokens": [first.decode("utf-8", errors="replace"), *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def join_logprobs_json(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions `logprobs` objects as one (the echoed prompt's, then the completion's,
    whose offsets already count the prompt: `logprobs_json(..., before=prompt bytes)`)."""
    if tail is None:
        return head
    return {key: [*head[key], *tail[key]] for key in head}
