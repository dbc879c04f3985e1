"""The OpenAI API's responses: bodies, server-sent event chunks and `usage` (with specedge's
acceptance rate and tokens per round as the extra field `usage.specedge`), from generation
results. Pure functions and frozen dataclasses; requests are `openai_api`."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .generation import GenerationResult
from .reply_reader import ReplyPart
from .tool_calls import ToolCall

__all__ = ["SSE_DONE", "ResponseShape", "assistant_message", "finish_reason", "sse",
           "tool_calls_json", "usage"]

SSE_DONE = b"data: [DONE]\n\n"
_FINISH = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context": "length"}


def finish_reason(stop_reason: str, called: bool = False) -> str:
    """OpenAI's finish_reason for a specedge stop reason ("tool_calls" when a reply that
    ended by itself made calls)."""
    reason = _FINISH.get(stop_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def tool_calls_json(calls: Sequence[ToolCall], key: str, first: int = 0, *, chunk: bool = False
                    ) -> list[dict[str, Any]]:
    """Calls as a message's `tool_calls`; a stream's chunks also number them within the reply,
    from `first`. Each id is a digest of `key` (the conversation the reply answers), the call's
    number and the call: the same in a stream's chunks, the whole body and the conversation an
    idle server prefills ahead (so a chat template that renders ids renders the ones the
    client sends back), and new with each turn (see `_call_id`)."""
    return [{**({"index": first + i} if chunk else {}), "id": _call_id(c, key, first + i),
             "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def _call_id(call: ToolCall, key: str, number: int) -> str:
    """`call_` and a digest of the conversation, the call's number and the call; where the
    model wrote an id of its own (Mistral Small 3.2's `[CALL_ID]`), the digest's first 15
    characters and that id, so that its template, which renders an id's last 9 letters and
    digits, renders the id the model wrote (the reply's tokens as generated)."""
    digest = hashlib.sha256(f"{key}\0{number}\0{call.name}\0{call.arguments}".encode()
                            ).hexdigest()
    return f"call_{digest[:15]}{call.model_id}" if call.model_id else f"call_{digest[:24]}"


def assistant_message(text: str, read: tuple[ReplyPart, bool] | None = None, key: str = ""
                      ) -> dict[str, Any]:
    """A whole chat reply as the response's `message`: its text, or what `ReplyReader` found
    in it and whether it reasoned (`read`): the answer as `content` (None when empty), the
    thinking as `reasoning_content` and the calls as `tool_calls` (ids from `key`, see
    `tool_calls_json`)."""
    if read is None:
        return {"role": "assistant", "content": text}
    part, reasoned = read
    message: dict[str, Any] = {"role": "assistant", "content": part.content or None}
    if reasoned and part.reasoning:
        message["reasoning_content"] = part.reasoning
    if part.calls:
        message["tool_calls"] = tool_calls_json(part.calls, key)
    return message


def usage(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """Token counts of a response's choices (with the prompt tokens a kept prefix held, as
    OpenAI reports cached ones), plus specedge's speculation statistics under "specedge"."""
    prompt = sum(len(r.prompt_tokens) for r in results)
    completion = sum(len(r.tokens) for r in results)
    proposed = sum(r.stats.proposed for r in results)
    accepted = sum(r.stats.accepted for r in results)
    rounds = sum(r.stats.rounds for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.cached_tokens
                                                           for r in results)},
            "specedge": {"acceptance_rate": round(accepted / proposed if proposed else 0.0, 4),
                         "tokens_per_round": round(1.0 + accepted / rounds if rounds else 0.0,
                                                   4),
                         "proposed": proposed, "accepted": accepted, "rounds": rounds}}


@dataclass(frozen=True)
class ResponseShape:
    """The id, kind and model of one response, and its bodies and chunks."""

    kind: str  # "chat" | "text"
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: str, model: str) -> ResponseShape:
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        return cls(kind, prefix + uuid.uuid4().hex, int(time.time()), model)

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.kind == "chat" \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str | None, finish: str | None,
                logprobs: dict[str, Any] | None, calls: list[dict[str, Any]] | None = None,
                reasoning: str | None = None) -> dict[str, Any]:
        """A completions choice, or a chat stream's chunk (`body` writes whole chat choices)."""
        if self.kind == "text":
            return {"index": index, "text": text or "", "logprobs": logprobs,
                    "finish_reason": finish}
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if text == "":  # the opening chunk
            delta = {"role": "assistant", "content": ""}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def body(self, choices: Sequence[tuple[GenerationResult, dict[str, Any] | None, str]],
             read: Sequence[tuple[ReplyPart, bool] | None] = (), key: str = ""
             ) -> dict[str, Any]:
        """The whole (non-streaming) response: per choice, its result, its logprobs (see
        `openai_logprobs`) and the echoed prompt its text starts with ("" without echo); and,
        for a chat reply read for reasoning or tool calls, what `ReplyReader` found in it and
        whether it reasoned (`read`, by choice; `key`: its calls' ids, see `tool_calls_json`)."""
        out = []
        for i, (result, logprobs, echo) in enumerate(choices):
            entry = read[i] if i < len(read) else None
            if self.kind == "text":
                out.append(self._choice(i, echo + result.text, finish_reason(result.stop_reason),
                                        logprobs))
                continue
            message = assistant_message(echo + result.text if entry is None else result.text,
                                        entry, key)
            finish = finish_reason(result.stop_reason, bool(message.get("tool_calls")))
            out.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": finish})
        return {**self._head(False), "choices": out,
                "usage": usage([result for result, _, _ in choices])}

    def chunk(self, text: str | None, finish: str | None = None,
              logprobs: dict[str, Any] | None = None, index: int = 0,
              calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> bytes:
        """One SSE event of choice `index`: a text delta ("" opens a chat stream; None with a
        finish_reason, calls or reasoning), with the logprobs of the tokens it adds (see
        `openai_logprobs`), the tool calls it completes (`tool_calls_json(chunk=True)`) and
        the reasoning text it adds."""
        return sse({**self._head(True), "choices": [
            self._choice(index, text, finish, logprobs, calls, reasoning)]})

    def usage_chunk(self, results: Sequence[GenerationResult]) -> bytes:
        """The final SSE event of `stream_options.include_usage`: no choices, the usage."""
        return sse({**self._head(True), "choices": [], "usage": usage(results)})


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"
