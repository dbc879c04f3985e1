"""The OpenAI API's requests as data: request bodies into `GenerationConfig` (responses are
`openai_responses`).

Follows the OpenAI API reference (https://platform.openai.com/docs/api-reference/chat and
/completions) the way the `openai` Python client uses it: `POST /v1/chat/completions` and
`POST /v1/completions`, and the error body `{"error": {"message", "type", "param", "code"}}`.

Pure functions and frozen dataclasses only: no HTTP, no decoding. Fields that would change what
a client gets back (`best_of`, `suffix`, ...) are refused
with a 400 naming the field; unknown fields that change nothing are ignored, as OpenAI does.
`logprobs` (chat: with `top_logprobs` 0..20; completions: 0..5) returns the target's
log-probability of every generated token (`runtime/logprobs`), in each API's own shape
(`runtime/openai_logprobs`); completions also take `echo` (the prompt's text, and its tokens'
logprobs, first). `logit_bias`, the presence and frequency penalties and vLLM's
`repetition_penalty` adjust the target's logits exactly as target-only decoding would
(`runtime/penalties`); `response_format` (JSON object or schema) and vLLM's
`structured_outputs` constrain the output to a grammar (`runtime/structured_api`); vLLM's
`min_tokens`, `ignore_eos` and `stop_token_ids` decide where the completion may end.
Chat requests take `tools`, `tool_choice` and `parallel_tool_calls` (`runtime/tool_calls`),
and conversations with earlier calls and tool results (`runtime/openai_messages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .chat_template import template_variables
from .errors import FieldError, InputError
from .generation import prompt_ids
from .logprobs import MAX_TOP_LOGPROBS
from .openai_messages import messages_field as _messages
from .pair import GenerationConfig, Prompt
from .policy import DRAFTER_CHOICES
from .sampling import SamplingParams, logit_bias_from_json
from .structured_api import StructuredFieldError, grammar_field
from .tool_set import ToolSet

__all__ = ["APIError", "ParsedRequest", "RequestDefaults", "error_body", "messages_field",
           "parse_request"]

MAX_STOPS = 16


class APIError(Exception):
    """An error answered to the client in OpenAI's format (never a traceback or a path)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class RequestDefaults:
    """What the server allows and assumes for fields a request leaves out.

    Attributes:
        model: the served model id (requests must name it).
        max_tokens_limit: the largest `max_tokens` a request may ask for; also the default.
        drafter, num_draft_tokens, adaptive: the server's decoding plan (None: the pair's).
        per_request_plan: False when the plan is shared by the running batch (concat pairs):
            a request may then only repeat the server's drafter and K.
        template_variables: chat template variables every chat request gets (a request's
            `chat_template_kwargs` add to them and override them).
    """

    model: str
    max_tokens_limit: int = 512
    drafter: str | None = None
    num_draft_tokens: int | None = None
    adaptive: bool | None = None
    per_request_plan: bool = True
    template_variables: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion request.

    Attributes:
        kind: "chat" (messages through the chat template) or "text" (plain prompts).
        prompts: the messages as `{"role", "content"}` dicts (chat; with their tool calls),
            or each prompt's text or token ids (completions: one choice each, in order).
        config: what to generate; `max_new_tokens` is the request's or the server's limit.
        max_tokens_given: whether the request set `max_tokens` itself.
        stream, include_usage: server-sent events, and a final usage chunk.
        echo: the completion's text (and logprobs) start with the prompt's (completions only).
        n: choices per prompt (a seeded request's choice j samples with seed + j).
        tools: the tools offered and how the reply may use them (chat; None: no tools).
        template_variables: the chat template's extra variables (the server's, then the
            request's `chat_template_kwargs`).
    """

    kind: str
    prompts: tuple[Prompt, ...]  # chat: one (the messages); completions: one or more
    config: GenerationConfig
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    echo: bool = False
    n: int = 1
    tools: ToolSet | None = None
    template_variables: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> Prompt:
        """The first (for chat, the only) prompt."""
        return self.prompts[0]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"'{param}': {message}", param=param, code=code)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int, *,
         expected: str | None = None) -> int | None:
    """`body[name]` as an integer in [lo, hi]; `expected` says what the field takes in the
    error (default: that range)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, f"expected {expected or f'an integer in [{lo}, {hi}]'}, got "
                         f"{_short(value)}")
    return value


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float, *,
            open_lo: bool = False, open_hi: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        ok = (lo < value if open_lo else lo <= value) and (value < hi if open_hi else value <= hi)
    if not ok:
        span = f"{'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"
        raise _bad(name, f"expected a number in {span}, got {_short(value)}")
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"expected true or false, got {_short(value)}")
    return value


# Fields that would change what the client gets back, and the values that change nothing.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""), "audio": (None,), "prediction": (None,),
    "modalities": (None, ["text"]),
}


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, harmless in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == h and type(value) is type(h) for h in harmless):
            raise _bad(name, f"{_short(value)} is not supported by this server",
                       code="unsupported_parameter")


def messages_field(value: Any) -> list[dict[str, Any]]:
    """A request's `messages`, checked (`runtime/openai_messages`).

    Raises:
        APIError: 400 naming the message and field at fault.
    """
    try:
        return _messages(value)
    except FieldError as exc:
        raise _bad(exc.param, str(exc)) from None


def _variables(kind: str, body: Mapping[str, Any], defaults: RequestDefaults
               ) -> Mapping[str, Any]:
    """The chat template's variables: the server's, with the request's
    `chat_template_kwargs` (vLLM's field) over them."""
    given = body.get("chat_template_kwargs")
    if given is not None and kind != "chat":
        raise _bad("chat_template_kwargs", "only the chat API (/v1/chat/completions) renders "
                                           "a chat template", code="unsupported_parameter")
    try:
        return {**defaults.template_variables, **template_variables(given)}
    except FieldError as exc:
        raise _bad(exc.param, str(exc)) from None


def _tools(kind: str, body: Mapping[str, Any]) -> ToolSet | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` (None: no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        return None
    if kind != "chat":
        raise _bad("tools", "only the chat API (/v1/chat/completions) takes tools",
                   code="unsupported_parameter")
    try:
        return ToolSet.from_openai(tools, choice, body.get("parallel_tool_calls"))
    except FieldError as exc:
        raise _bad(exc.param, str(exc)) from None


MAX_PROMPTS = 256  # prompts in one completions request
MAX_N = 16  # choices per prompt


def _one_prompt(value: Any) -> str | list[int] | None:
    """A prompt's text or token ids; None for anything else."""
    if (ids := prompt_ids(value)) is not None:
        return ids
    return value if isinstance(value, str) and value else None


def _prompts(value: Any) -> tuple[str | list[int], ...]:
    """The completions `prompt`: a string or a list of token ids, or a list of those (one
    choice each, as the `openai` client and evaluation harnesses send batches)."""
    if (one := _one_prompt(value)) is not None:
        return (one,)
    if isinstance(value, list) and 0 < len(value) <= MAX_PROMPTS:
        many = [_one_prompt(v) for v in value]
        if all(p is not None for p in many):
            return tuple(p for p in many if p is not None)
    raise _bad("prompt", f"expected a non-empty string or list of token ids, or a list of 1 to "
                         f"{MAX_PROMPTS} of them")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"expected a non-empty string or a list of up to {MAX_STOPS} "
                           "non-empty strings")
    return tuple(stops)


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _int(body, "seed", -(2**63), 2**64 - 1, expected="a 64-bit integer")
    return None if seed is None else seed % 2**64  # OpenAI seeds are signed 64-bit


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_k = _int(body, "top_k", 0, 1_000_000)
    top_p = _number(body, "top_p", 0.0, 1.0, open_lo=True)
    min_p = _number(body, "min_p", 0.0, 1.0, open_hi=True)
    # OpenAI's default temperature is 1 (sampling); 0 is greedy.
    return SamplingParams(temperature=1.0 if temperature is None else temperature,
                          top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
                          min_p=min_p or 0.0, seed=_seed(body),
                          presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
                          frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0)
                          or 0.0,
                          repetition_penalty=_number(body, "repetition_penalty", 0.0, 10.0,
                                                     open_lo=True) or 1.0,
                          logit_bias=_logit_bias(body.get("logit_bias")),
                          min_tokens=_int(body, "min_tokens", 0, 1_000_000) or 0)


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    """vLLM's `stop_token_ids`: tokens that end the completion, as eos does."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > 64 or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value):
        raise _bad("stop_token_ids", f"expected a list of at most 64 token ids, got "
                                     f"{_short(value)}")
    return tuple(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    try:
        return logit_bias_from_json(value)
    except InputError as exc:
        raise _bad("logit_bias", str(exc)) from None


MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit


def _logprobs(kind: str, body: Mapping[str, Any]) -> int | None:
    """How many alternatives per token the request asks for (None: no logprobs). Chat:
    `logprobs` true, with `top_logprobs`; completions: `logprobs` 0..5."""
    if kind == "text":
        return _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top is not None:
            raise _bad("top_logprobs", "only allowed with logprobs: true")
        return None
    return top or 0


def _plan_fields(body: Mapping[str, Any], defaults: RequestDefaults
                 ) -> tuple[str | None, int | None, bool | None]:
    drafter = body.get("drafter")
    if drafter is not None and drafter not in DRAFTER_CHOICES:
        raise _bad("drafter", f"expected one of {', '.join(DRAFTER_CHOICES)}, got "
                              f"{_short(drafter)}")
    k = _int(body, "num_draft_tokens", 1, 64)
    if defaults.per_request_plan:
        return (drafter or defaults.drafter, k or defaults.num_draft_tokens, defaults.adaptive)
    for name, value, server in (("drafter", drafter, defaults.drafter),
                                ("num_draft_tokens", k, defaults.num_draft_tokens)):
        if value is not None and value != server:
            raise _bad(name, "the running batch shares one drafter and K; this server uses "
                             f"{name}={server!r} (set at `specedge serve` start)")
    return defaults.drafter, defaults.num_draft_tokens, defaults.adaptive


def _max_tokens(body: Mapping[str, Any], defaults: RequestDefaults) -> int | None:
    limit = defaults.max_tokens_limit
    expected = f"an integer in [1, {limit}] (this server's --max-tokens-limit)"
    given = [_int(body, name, -(2**63), 2**63, expected=expected)
             for name in ("max_completion_tokens", "max_tokens")]
    value = next((v for v in given if v is not None), None)
    if value is not None and not 1 <= value <= limit:
        name = "max_completion_tokens" if given[0] is not None else "max_tokens"
        raise _bad(name, f"expected {expected}, got {value}")
    return value


def _check_model(body: Mapping[str, Any], defaults: RequestDefaults) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", f"expected the model id {defaults.model!r}")
    if model != defaults.model:
        raise APIError(404, f"The model {_short(model)} does not exist; this server serves "
                            f"{defaults.model!r} (GET /v1/models).", param="model",
                       code="model_not_found")


def _stream_fields(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _bad("stream_options", f"expected an object, got {_short(options)}")
    if not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    return stream, _bool(options, "include_usage")


def parse_request(kind: str, body: Any, defaults: RequestDefaults) -> ParsedRequest:
    """Validate a chat ("chat") or completions ("text") request body.

    Raises:
        APIError: 400 naming the offending field; 404 for a model this server does not serve.
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_model(body, defaults)
    _refuse_unsupported(body)
    prompts: tuple[Prompt, ...] = (messages_field(body.get("messages")),) if kind == "chat" \
        else _prompts(body.get("prompt"))
    stream, include_usage = _stream_fields(body)
    max_tokens = _max_tokens(body, defaults)
    drafter, k, adaptive = _plan_fields(body, defaults)
    try:
        grammar = grammar_field(body)
    except StructuredFieldError as exc:
        raise _bad(exc.param, str(exc)) from None
    try:
        config = GenerationConfig(max_new_tokens=max_tokens or defaults.max_tokens_limit,
                                  sampling=_sampling(body), num_draft_tokens=k,
                                  drafter=drafter, adaptive=adaptive, stop=_stop(body.get("stop")),
                                  logprobs=_logprobs(kind, body), grammar=grammar,
                                  ignore_eos=_bool(body, "ignore_eos"),
                                  stop_token_ids=_stop_token_ids(body.get("stop_token_ids")))
    except InputError as exc:  # ranges the helpers above leave to the runtime's own checks
        raise APIError(400, str(exc)) from None
    echo = _bool(body, "echo")
    if echo and kind == "chat":
        raise _bad("echo", "only the completions API (/v1/completions) takes echo",
                   code="unsupported_parameter")
    n = _int(body, "n", 1, MAX_N) or 1
    return ParsedRequest(kind, prompts, config, max_tokens is not None, stream, include_usage,
                         echo, n, _tools(kind, body), _variables(kind, body, defaults))
