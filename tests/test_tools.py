"""Tool calling: `tools` / `tool_choice` checked, the prompt rendered (a template that takes
tools, and one that does not), calls forced by a grammar decoded exactly under speculation, and
found in whole and streamed replies, through the real server and the `openai` client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime.errors import InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.server import ServerOptions, create_app
from specedge.runtime.text import Tokenizer
from specedge.runtime.tool_calls import (
    GRANITE3,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    PHI4,
    TOOL_FORMATS,
    ToolCall,
    ToolFormat,
    ToolOutput,
)
from specedge.runtime.tool_prompt import ToolPlan
from specedge.runtime.tool_set import Tool, ToolInputError, ToolSet
from specedge.runtime.tool_stream import ToolStream

from .test_hardening import pair_copy, rehash
from .test_penalties import rows_three_ways
from .test_serve import FORMS, Served, running

__all__ = ["pair_copy"]  # a fixture, imported for the tests below

WEATHER = {"type": "function", "function": {
    "name": "weather",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8}}}}}
CLOCK = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "additionalProperties": False,
                                   "required": ["zone"],
                                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# A Hermes-style template that renders tools itself, as Qwen2.5's does (written for this test).
NATIVE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Call them inside <tool_call></tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def calls_of(fmt: ToolFormat, text: str) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in fmt.parse(text).calls]


def fits(name: str, arguments: dict[str, Any]) -> bool:
    """The arguments fit the tool's schema (the two schemas above, checked by hand)."""
    if name == "weather":
        return set(arguments) == {"city"} and isinstance(arguments["city"], str) and \
            len(arguments["city"]) <= 8
    return name == "time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


# ------------------------------------------------------------------------------ the request


def test_tools_and_tool_choice_are_checked() -> None:
    tools = ToolSet.from_openai(TOOLS)
    assert tools.choice == "auto" and tools.parallel and tools.forced() == ()
    assert [t.name for t in ToolSet.from_openai(TOOLS, "required").forced()] == \
        ["weather", "time"]
    named = ToolSet.from_openai(TOOLS, {"type": "function", "function": {"name": "time"}},
                                False)
    assert [t.name for t in named.forced()] == ["time"] and not named.parallel
    assert ToolSet.from_openai(TOOLS, "none").forced() == ()
    for tools_value, choice, param in [
            ([], None, "tools"), ("x", None, "tools"), ([{"type": "code"}], None, "tools[0]"),
            ([{"type": "function", "function": {"name": "bad name"}}], None,
             "tools[0].function.name"),
            ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
             "tools[0].function.parameters"),
            ([WEATHER, WEATHER], None, "tools"),
            (TOOLS, "sometimes", "tool_choice"),
            (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice")]:
        with pytest.raises(ToolInputError) as caught:
            ToolSet.from_openai(tools_value, choice)
        assert caught.value.param == param, (tools_value, choice)


def test_parse_finds_calls_and_keeps_the_rest_as_text() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert HERMES.parse(call) == ToolOutput(None, (ToolCall("f", '{"a": 1}'),))
    two = HERMES.parse(f"Sure. {call}\n{call} Done.")
    assert two.content == "Sure. \n Done." and len(two.calls) == 2
    assert HERMES.parse("no calls here ") == ToolOutput("no calls here")
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert HERMES.parse(broken) == ToolOutput(broken)
    assert HERMES.parse('<tool_call>\n{"name": "f", "arguments": {}}') == \
        ToolOutput(None, (ToolCall("f", "{}"),))  # cut before its closing tag
    assert HERMES.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>') == \
        ToolOutput(None, (ToolCall("f", "{}"),))  # the tags on the JSON's line
    assert LLAMA3_JSON.parse(' {"name": "f", "parameters": {"x": "y"}}') == \
        ToolOutput(None, (ToolCall("f", '{"x": "y"}'),))
    assert LLAMA3_JSON.parse('{"answer": 1}') == ToolOutput('{"answer": 1}')
    assert LLAMA3_JSON.parse("Hello") == ToolOutput("Hello")
    two_calls = (ToolCall("f", '{"a": 1}'), ToolCall("g", "{}"))
    for fmt in (MISTRAL, GRANITE3):  # one array of calls after the tag
        tag = fmt.open_tag
        assert fmt.parse(f'{tag}[{{"name": "f", "arguments": {{"a": 1}}}}, '
                         '{"name": "g", "arguments": {}}]') == ToolOutput(None, two_calls)
        assert fmt.parse(f'Sure. {tag} {{"name": "g", "arguments": {{}}}} ok') == \
            ToolOutput("Sure.  ok", two_calls[1:])  # one object, and text around it
        for text in (f"{tag} not json", f"{tag}[1, 2]", f"{tag}[]", "plain"):
            assert fmt.parse(text) == ToolOutput(text)
    assert PHI4.parse('<|tool_call|>{"name": "g", "arguments": {}}<|/tool_call|>') == \
        ToolOutput(None, two_calls[1:])
    for fmt in TOOL_FORMATS:
        written = ToolCall("weather", '{"city": "Oslo", "days": [1, 2]}')
        (parsed,) = fmt.parse(fmt.write(written)).calls
        assert replace(parsed, model_id=None) == written, fmt.name
        assert (parsed.model_id is not None) == bool(fmt.id_tag), fmt.name  # the id it wrote
        assert fmt.write(parsed) == fmt.write(written), fmt.name
    for marker, fmt in (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL),
                        ("[TOOL_CALLS]' + name + '[ARGS]", MISTRAL_ARGS),
                        ("[TOOL_CALLS]' + name + '[CALL_ID]' + id + '[ARGS]", MISTRAL_CALL_ID),
                        ("<|tool_call|>", GRANITE3), ("<|tool_call|><|/tool_call|>", PHI4),
                        ("<|start_header_id|>", LLAMA3_JSON), ("plain", None)):
        assert ToolFormat.for_template(f"{{{{ tools }}}}{marker}") is fmt, marker


def test_mistral_v11_calls_write_each_name_before_its_arguments() -> None:
    """`[TOOL_CALLS]name[ARGS]{...}` a call (Ministral 3, Magistral), a call id between
    `[CALL_ID]` and `[ARGS]` for Mistral Small 3.2; anything else after the tag is text, and
    so is all that follows a call that does not parse."""
    f, g = ToolCall("f", '{"a": 1}'), ToolCall("get-time_2", "{}")
    for fmt in (MISTRAL_ARGS, MISTRAL_CALL_ID):
        assert fmt.parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]get-time_2[ARGS]{}') == \
            ToolOutput(None, (f, g))
        assert fmt.parse('Sure. [TOOL_CALLS] f [ARGS] {"a": 1} ok') == \
            ToolOutput("Sure.  ok", (f,))
        for text in ("[TOOL_CALLS]f[ARGS]null", "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f{}",
                     "[TOOL_CALLS]two words[ARGS]{}", "[TOOL_CALLS][ARGS]{}",
                     '[TOOL_CALLS]f[ARGS]{"a": ', "[TOOL_CALLS]f[ARGS]{bad}", "plain"):
            assert fmt.parse(text) == ToolOutput(text.strip()), (fmt.name, text)
        assert fmt.parse('[TOOL_CALLS]f[ARGS]{"a": 1} [TOOL_CALLS]x y[ARGS]{}') == \
            ToolOutput("[TOOL_CALLS]x y[ARGS]{}", (f,))
    assert MISTRAL_CALL_ID.parse('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}') == \
        ToolOutput(None, (replace(f, model_id="a1b2c3d4e"),))
    written = MISTRAL_CALL_ID.write(f)
    assert re.fullmatch(r'\[TOOL_CALLS\]f\[CALL_ID\][0-9a-f]{9}\[ARGS\]\{"a": 1\}', written)
    assert MISTRAL_ARGS.write(f) == '[TOOL_CALLS]f[ARGS]{"a": 1}'
    assert MISTRAL_CALL_ID.tags == ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")


_PIECES = st.lists(st.sampled_from([
    "Hi", " ", "\n", "text", "<", "<tool", "tool_call>", "{", "}", "<tool_call>",
    '{"name": "k", "arguments": {}}',
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>',
    '<tool_call>\n{"name": "g"}\n</tool_call>', "<tool_call>\nbad\n</tool_call>",
    '{"name": "h", "parameters": {}}', "; ", "</tool_call>", "[TOOL_CALLS]", "<|tool_call|>",
    "[TOOL", "<|/tool_call|>", "[", "]", ", ", '[{"name": "m", "arguments": {"b": 2}}]',
    '{"name": "n", "arguments": {}}']), max_size=8)


@settings(max_examples=600)
@given(pieces=_PIECES, data=st.data(), fmt=st.sampled_from(TOOL_FORMATS))
def test_a_streamed_reply_gives_what_the_whole_reply_gives(pieces: list[str], data: Any,
                                                           fmt: ToolFormat) -> None:
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    bounds = sorted({0, len(text), *cuts})
    stream, content, calls = ToolStream(fmt), "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        more, found = stream.feed(text[a:b])
        content, calls = content + more, calls + found
    more, found = stream.finish()
    whole = fmt.parse(text)
    assert (content + more or None, tuple(calls + found)) == (whole.content, whole.calls)


_NAMED_CALL = st.tuples(
    st.sampled_from(["[TOOL_CALLS]", "[TOOL_CALLS]", "[TOOL"]),
    st.sampled_from(["f", "get_time-2", " f ", "x y", "", "f" * 70, "f["]),
    st.sampled_from(["", "", "[CALL_ID]a1b2c3d4e", "[CALL_ID]", "[CALL"]),
    st.sampled_from(["[ARGS]", "[ARGS]", " [ARGS] ", "[AR", ""]),
    st.sampled_from(['{"a": 1}', "{}", '{"b": [1, {"c": "}"}]}', "null", "[1]", "{", '{"a": ',
                     "{bad}", ""])).map("".join)
_NAMED_PIECES = st.lists(st.one_of(_NAMED_CALL, st.sampled_from(
    ["Hi", " ", "\n", "text", "[", "]", "{", "}", "[ARGS]", "f"])), max_size=5)


@settings(max_examples=800)
@given(pieces=_NAMED_PIECES, data=st.data(), fmt=st.sampled_from([MISTRAL_ARGS,
                                                                 MISTRAL_CALL_ID]))
def test_streamed_mistral_v11_calls_are_the_whole_replys(pieces: list[str], data: Any,
                                                        fmt: ToolFormat) -> None:
    """Streamed at any cuts, a reply of name-then-arguments calls gives what parsing it
    whole gives, and a call is given out as soon as its arguments close."""
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    bounds = sorted({0, len(text), *cuts})
    stream, content, calls = ToolStream(fmt), "", list[ToolCall]()
    for a, b in zip(bounds, bounds[1:], strict=False):
        more, found = stream.feed(text[a:b])
        content, calls = content + more, calls + found
        assert tuple(calls) == fmt.parse(text[:b]).calls  # each call once its JSON closes
    more, found = stream.finish()
    whole = fmt.parse(text)
    assert (content + more or None, tuple(calls + found)) == (whole.content, whole.calls)


def test_a_streamed_mistral_v11_tag_that_opens_no_call_is_text_at_once() -> None:
    """Text after `[TOOL_CALLS]` that cannot become a call is sent as soon as that shows, not
    held to the end of the reply; text that still may become one is held."""
    for fmt in (MISTRAL_ARGS, MISTRAL_CALL_ID):
        for text in ("Hi [TOOL_CALLS]two words", "Hi [TOOL_CALLS]f[ARGS]null",
                     "Hi [TOOL_CALLS]f[ARGS] [1", "Hi [TOOL_CALLS]" + "f" * 65,
                     "Hi [TOOL_CALLS]f!"):
            assert ToolStream(fmt).feed(text) == (text, []), (fmt.name, text)
        for text in ("Hi [TOOL_CALLS]f", "Hi [TOOL_CALLS]f [AR", "Hi [TOOL_CALLS]f[ARGS]",
                     'Hi [TOOL_CALLS]f[ARGS] {"a": '):
            assert ToolStream(fmt).feed(text) == ("Hi", []), (fmt.name, text)
    for text in ("Hi [TOOL_CALLS]f[CALL", "Hi [TOOL_CALLS]f[CALL_ID]x y"):  # an id follows
        assert ToolStream(MISTRAL_CALL_ID).feed(text) == ("Hi", [])
        assert ToolStream(MISTRAL_ARGS).feed(text) == (text, [])


# ------------------------------------------------------------------------------ the prompt


def test_a_template_without_tools_gets_them_in_its_system_message(tiny_pair: Pair) -> None:
    plan = ToolPlan.for_tokenizer(tiny_pair.tokenizer, ToolSet.from_openai(TOOLS))
    assert (plan.fmt, plan.native) == (HERMES, False)
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    messages, tools = plan.messages(history)
    assert tools is None and messages[0]["role"] == "system"
    assert '"name": "weather"' in messages[0]["content"]
    assert messages[2]["content"] == HERMES.write(ToolCall("weather", '{"city": "Paris"}'))
    assert messages[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    text = tiny_pair.tokenizer.decode(plan.prompt_ids(tiny_pair.tokenizer, history),
                                      skip_special_tokens=False)
    assert "<tools>" in text and text.endswith("<|im_start|>assistant\n")
    none = ToolPlan.for_tokenizer(tiny_pair.tokenizer, ToolSet.from_openai(TOOLS, "none"))
    assert "<tools>" not in tiny_pair.tokenizer.render_chat(none.messages(ASK)[0])


def test_a_template_that_takes_tools_renders_them(tiny_pair: Pair) -> None:
    backend = tiny_pair.tokenizer._backend
    tokenizer = Tokenizer(backend, chat_template=NATIVE_TEMPLATE, eos_token="<|im_end|>")
    assert tokenizer.chat_takes_tools
    plan = ToolPlan.for_tokenizer(tokenizer, ToolSet.from_openai(TOOLS, "required"))
    assert (plan.fmt, plan.native) == (HERMES, True)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    messages, tools = plan.messages(history)
    text = tokenizer.render_chat(messages, tools=tools)
    assert '"name": "time"' in text  # the tools, as the template lists them
    # The call's arguments reach the template as an object (as transformers passes them).
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text


def test_an_arguments_schema_that_does_not_compile_is_a_clear_error() -> None:
    bad = {"type": "function", "function": {"name": "f",
                                            "parameters": {"type": "object", "minProperties": -1,
                                                           "properties": {"a": {"type": 7}}}}}
    with pytest.raises(InputError, match="does not compile"):
        HERMES.grammar(ToolSet.from_openai([bad], "required").forced(), True)


# ------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("form", list(FORMS))
def test_forced_calls_are_exact_under_speculation(fixtures_dir: Path, form: str) -> None:
    """tool_choice "required" / named: every drafter gives the target-only tokens, greedy and
    seeded, and every reply is calls that fit their schemas."""
    pair = Pair.load(fixtures_dir / FORMS[form])
    for choice in ("required", {"type": "function", "function": {"name": "time"}}):
        plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, choice))
        ids = plan.prompt_ids(pair.tokenizer, ASK)
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9,
                                                                         seed=5)):
            config = GenerationConfig(max_new_tokens=120, grammar=plan.grammar,
                                      sampling=sampling)
            want = pair.generate(ids, replace(config, drafter="none"))
            for drafter in ("model", "ngram", "hybrid"):
                got = pair.generate(ids, replace(config, drafter=drafter,
                                                 num_draft_tokens=3))
                assert got.tokens == want.tokens, (choice, sampling, drafter)
            if want.stop_reason == "eos":
                calls = calls_of(plan.fmt, want.text)
                assert calls and all(fits(n, a) for n, a in calls), want.text
                assert choice == "required" or {n for n, _ in calls} == {"time"}


def test_forced_calls_in_batches_equal_batch_one(fixtures_dir: Path) -> None:
    pair = Pair.load(fixtures_dir / FORMS["concat"])
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required"))
    prompts = [plan.prompt_ids(pair.tokenizer, [{"role": "user", "content": q}])
               for q in ("Weather in Oslo?", "Time in Paris?", "Hi")]
    configs = [GenerationConfig(max_new_tokens=90, grammar=plan.grammar, drafter="model",
                                num_draft_tokens=3, adaptive=False),
               GenerationConfig(max_new_tokens=90, grammar=plan.grammar, drafter="model",
                                num_draft_tokens=3, adaptive=False,
                                sampling=SamplingParams(temperature=0.8, seed=2)),
               GenerationConfig(max_new_tokens=40, drafter="model", num_draft_tokens=3,
                                adaptive=False)]
    rows_three_ways(pair, prompts, configs)  # batch 1, a batch, a continuous batch agree


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module", params=list(FORMS))
def served(request: pytest.FixtureRequest, fixtures_dir: Path) -> Iterator[Served]:
    pair = Pair.load(fixtures_dir / FORMS[request.param])
    app = create_app(pair, ServerOptions(max_batch=4, max_queue=16, max_tokens_limit=512))
    with running(app) as url:
        yield Served(pair, url, app)


def _solo(pair: Pair, plan: ToolPlan, messages: list[dict[str, Any]]) -> Any:
    """Target-only decoding of what the server is sent without `max_tokens` (the rest of the
    tiny models' 512-token context)."""
    ids = plan.prompt_ids(pair.tokenizer, messages)
    return pair.generate(ids, GenerationConfig(max_new_tokens=512 - len(ids),
                                               grammar=plan.grammar, drafter="none"))


def test_required_calls_through_the_openai_client(served: Served) -> None:
    client, pair = served.client(), served.pair
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required",
                                                                      False))
    want = _solo(pair, plan, ASK)
    assert want.stop_reason == "eos"  # one call, then the grammar allows only eos
    expected = calls_of(plan.fmt, want.text)
    reply = client.chat.completions.create(model=served.model, messages=ASK, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments))
           for c in choice.message.tool_calls or []]
    assert got == expected and all(fits(n, a) for n, a in got)
    assert reply.usage is not None and reply.usage.completion_tokens == len(want.tokens)
    ids = {c.id for c in choice.message.tool_calls or []}
    assert len(ids) == len(got) and all(i.startswith("call_") for i in ids)
    chunks = list(client.chat.completions.create(
        model=served.model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, stream=True))
    streamed: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == \
        expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_named_function_and_a_conversation_with_results(served: Served) -> None:
    client, pair = served.client(), served.pair
    named = {"type": "function", "function": {"name": "time"}}
    reply = client.chat.completions.create(model=served.model, messages=ASK, tools=[CLOCK],
                                           tool_choice=named, parallel_tool_calls=False,
                                           temperature=0)
    calls = reply.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["time"]
    history: list[dict[str, Any]] = [
        *ASK, {"role": "assistant", "content": None,
               "tool_calls": [{"id": calls[0].id, "type": "function",
                               "function": {"name": "time",
                                            "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}]
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai([CLOCK]))
    want = _solo(pair, plan, history)
    after = client.chat.completions.create(model=served.model, messages=history,
                                           tools=[CLOCK], temperature=0)
    assert after.usage is not None
    assert after.usage.prompt_tokens == len(plan.prompt_ids(pair.tokenizer, history))
    found = plan.fmt.parse(want.text)
    assert after.choices[0].message.content == found.content  # "auto": read for calls
    assert len(after.choices[0].message.tool_calls or []) == len(found.calls)


def test_tool_requests_that_are_wrong_are_400s(served: Served) -> None:
    url = served.url + "/v1/chat/completions"
    base = {"model": served.model, "messages": ASK, "max_tokens": 5}
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 7}}}}}
    for extra, param in [
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
             "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [bad_schema], "tool_choice": "required"}, "tools"),
            ({"tools": TOOLS, "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
             "tools[0].function.name"),
            ({"messages": [{"role": "user", "content": "x", "tool_calls": []},
                           {"role": "tool", "content": None}]}, "messages[1].content"),
            ({"messages": [{"role": "assistant", "content": None,
                            "tool_calls": [{"function": {"arguments": "{}"}}]}]},
             "messages[0].tool_calls[0]")]:
        response = httpx.post(url, json={**base, **extra}, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "\n" not in error["message"], (extra, error)
    text = httpx.post(served.url + "/v1/completions",
                      json={"model": served.model, "prompt": "Hi", "tools": TOOLS}, timeout=30)
    assert text.status_code == 400 and text.json()["error"]["param"] == "tools"


def test_a_template_that_takes_tools_through_the_server(pair_copy: Path) -> None:
    (pair_copy / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    rehash(pair_copy, "chat_template.jinja")
    pair = Pair.load(pair_copy)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required"))
    assert plan.native
    want = _solo(pair, plan, ASK)
    with running(create_app(pair, ServerOptions())) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": pair.manifest.root.name, "messages": ASK, "tools": TOOLS,
            "tool_choice": "required", "temperature": 0}).json()
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        calls_of(plan.fmt, want.text)
    assert reply["usage"]["prompt_tokens"] == len(plan.prompt_ids(pair.tokenizer, ASK))


@pytest.mark.reference
def test_the_reference_model_calls_the_weather_tool(reference_pair: Pair) -> None:
    plan = ToolPlan.for_tokenizer(reference_pair.tokenizer,
                                  ToolSet.from_openai(TOOLS, "required", False))
    ids = plan.prompt_ids(reference_pair.tokenizer, ASK)
    want = reference_pair.generate(ids, GenerationConfig(max_new_tokens=60, drafter="none",
                                                         grammar=plan.grammar))
    got = reference_pair.generate(ids, GenerationConfig(max_new_tokens=60, grammar=plan.grammar))
    assert got.tokens == want.tokens
    assert calls_of(plan.fmt, got.text) == [("weather", {"city": "Paris"})]


def test_an_ngram_hit_that_leaves_the_grammar_is_cut(tiny_pair: Pair) -> None:
    """A constrained row's n-gram drafts stop at the first token the grammar forbids (the
    prompt lists the tools' schemas, whose text a call does not repeat): verification would
    reject the rest, and hybrid drafting then falls back to the draft model."""
    from specedge.runtime.drafters import NgramDrafter
    from specedge.runtime.rounds import RowSampler

    plan = ToolPlan.for_tokenizer(tiny_pair.tokenizer, ToolSet.from_openai(TOOLS, "required"))
    assert plan.grammar is not None
    tokenizer = tiny_pair.tokenizer
    state = tiny_pair.grammars.state(plan.grammar)
    sampler = RowSampler(SamplingParams(temperature=0.0), tiny_pair.target.spec.vocab_size,
                         grammar=state)
    good = tokenizer.encode('<tool_call>\n{"name": "time", "arguments": {"zone": "UTC"}}',
                            add_special_tokens=False)
    bad = tokenizer.encode(' "type": "object"', add_special_tokens=False)
    head = good[:4]
    assert sampler.allowed(head, good[4:]) == good[4:]
    assert sampler.allowed(head, bad) == []
    cut = sampler.allowed(head, good[4:9] + bad)
    assert cut == good[4:9]
    # The drafter: a prompt that holds the good text then the bad one after the same n-gram.
    prompt = good[:9] + bad + [0] + head
    assert NgramDrafter().lookup(prompt, 8)[:6] == good[4:9] + bad[:1]
    assert NgramDrafter().propose(prompt, 8, sampler, len(head), 8).tokens.tolist() == \
        good[4:9]


def test_generate_with_tools_from_the_command_line(tiny_pair_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from .test_cli import assert_clean_error, generate_json, invoke

    runner = CliRunner()
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps([CLOCK]))
    pair = Pair.load(tiny_pair_dir)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(
        [CLOCK], {"type": "function", "function": {"name": "time"}}))
    ids = plan.prompt_ids(pair.tokenizer, ASK)
    want = pair.generate(ids, GenerationConfig(max_new_tokens=100, grammar=plan.grammar,
                                               drafter="none"))
    out = generate_json(runner, tiny_pair_dir, ASK[0]["content"], "--tools", str(tools_file),
                        "--tool-choice", "time", "--max-new-tokens", "100")
    assert out["tokens"] == want.tokens and out["content"] is None
    assert [(c["name"], json.loads(c["arguments"])) for c in out["tool_calls"]] == \
        calls_of(plan.fmt, want.text) and out["tool_calls"]
    (tmp_path / "bad.json").write_text(json.dumps([{"type": "function",
                                                     "function": {"name": "a b"}}]))
    (tmp_path / "not.json").write_text("{")
    for args, message in (
            (("--tools", tmp_path / "bad.json"), "tools[0].function.name"),
            (("--tools", tmp_path / "not.json"), "not JSON"),
            (("--tools", tools_file, "--tool-choice", "nope"), "names function 'nope'"),
            (("--tools", tools_file, "--tool-choice", "required", "--regex", "a"),
             "not both")):
        assert_clean_error(invoke(runner, "generate", tiny_pair_dir, "Hi", *args), message)
    usage = invoke(runner, "generate", tiny_pair_dir, "Hi", "--tool-choice", "required")
    assert usage.exit_code == 2 and "--tool-choice needs --tools" in usage.output


def test_a_forced_call_may_write_its_tags_as_the_tokenizers_own(pair_copy: Path) -> None:
    """Qwen's `<tool_call>` and `</tool_call>` are tokens of their own: a forced call's grammar
    takes them as those tokens (as the model writes them; before, only as text pieces the
    model never writes) or as text, and the server reads the calls either way."""
    from .test_reasoning import own_tokens

    (pair_copy / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    rehash(pair_copy, "chat_template.jinja")
    opening, closing = own_tokens(pair_copy, ("<tool_call>", "</tool_call>"))
    pair = Pair.load(pair_copy)
    grammar = HERMES.grammar([Tool("time", "", '{"type": "object", "properties": {}, '
                                               '"additionalProperties": false}')], False)
    encode = pair.tokenizer.encode
    body = encode('\n{"name": "time", "arguments": {}}\n')
    for ids in ([opening, *body, closing],
                [*encode("<"), *encode("tool_call>"), *body, *encode("</"), *encode("tool_call>")]):
        assert pair.grammars.state(grammar).allowed_prefix([], ids) == len(ids), ids
    tools = [{"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(tools, "required"))
    bias = {opening: 30.0, closing: 30.0}  # the random model writes the tags as the tokens
    want = pair.generate(plan.prompt_ids(pair.tokenizer, ASK), GenerationConfig(
        max_new_tokens=64, drafter="none", grammar=plan.grammar,
        sampling=SamplingParams(temperature=0, logit_bias=bias)))
    assert want.tokens[0] == opening and closing in want.tokens
    with running(create_app(pair, ServerOptions())) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": pair.manifest.root.name, "messages": ASK, "tools": tools,
            "tool_choice": "required", "temperature": 0, "max_tokens": 64,
            "logit_bias": {str(t): b for t, b in bias.items()}}).json()
    message = reply["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["time"]
    assert reply["usage"]["completion_tokens"] == len(want.tokens)


def _served_calls(pair: Pair) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The calls (name, arguments) the server returns for `ASK` with `TOOLS` required, whole
    and streamed, through the `openai` client (a whole reply with calls has no content)."""
    import openai

    with running(create_app(pair, ServerOptions())) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        kwargs: dict[str, Any] = {"model": pair.manifest.root.name, "messages": ASK,
                                  "tools": TOOLS, "tool_choice": "required", "temperature": 0}
        whole = client.chat.completions.create(**kwargs).choices[0].message
        assert whole.content is None
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [c.function for chunk in chunks if chunk.choices
                for c in chunk.choices[0].delta.tool_calls or []]
    return ([(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls or []],
            [(f.name, json.loads(f.arguments or "")) for f in streamed])


# A Mistral-style template (written for this test): the tools before the user turn, and calls
# as one JSON array after the [TOOL_CALLS] token, which the tokenizer marks special.
MISTRAL_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS] [
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('call ids are 9 letters and digits') }}{% endif %}
{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]<|im_end|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {{ message.tool_call_id }}:
{{- ' ' + message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}"""


def test_mistral_calls_after_a_special_token(pair_copy: Path) -> None:
    """Mistral's format: the template's marker picks it, the special [TOOL_CALLS] stays in the
    decoded text, a forced reply is the tag and one array of calls fitting their schemas, and
    the server returns them whole and streamed as target-only decoding finds them."""

    from .test_reasoning import own_tokens

    (pair_copy / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    rehash(pair_copy, "chat_template.jinja")
    (tag,) = own_tokens(pair_copy, ("[TOOL_CALLS]",), special=True)
    pair = Pair.load(pair_copy)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required"))
    assert plan.native and plan.fmt is MISTRAL
    assert pair.tokenizer.decode([tag, *pair.tokenizer.encode("[]")]) == "[TOOL_CALLS][]"
    want = _solo(pair, plan, ASK)
    assert want.tokens[0] == tag  # the grammar takes the tag as its token
    found = calls_of(MISTRAL, want.text)
    assert found and all(fits(name, arguments) for name, arguments in found)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    rendered = plan.prompt_text(pair.tokenizer, history)  # "call_1": not the 9 characters
    assert '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}]' in rendered
    (call_id,) = re.findall(r"\[TOOL_RESULTS\] (\w+): sunny", rendered)
    assert len(call_id) == 9 and call_id.isalnum()  # the call's id, as the template takes it
    assert _served_calls(pair) == (found, found)


# Mistral v11+ templates (written for this test after Ministral 3's and Mistral Small 3.2's):
# each call is [TOOL_CALLS], its name, (Small 3.2: [CALL_ID] and a 9-character id,) [ARGS]
# and its arguments; the tags are special tokens.
MISTRAL_V11_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}
{%- for call in message.tool_calls %}
{%- set arguments = call.function.arguments %}
{%- if arguments is not string %}{% set arguments = arguments | tojson %}{% endif %}
{{- '[TOOL_CALLS]' + call.function.name }}CALL_ID
{{- '[ARGS]' + arguments }}
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}"""
CALL_ID = """
{%- if call.id | length != 9 %}{{ raise_exception('call ids are 9 letters and digits') }}{% endif %}
{{- '[CALL_ID]' + call.id }}"""


def test_the_call_id_a_model_wrote_is_the_one_its_template_renders_back() -> None:
    """Mistral Small 3.2 writes an id after each call's name. The server returned a digest
    id instead, which its template rendered back as the digest's last 9 characters: the
    conversation the client sent back differed from the reply's tokens as generated, so the
    reply's cache was reused only up to the id. Now the returned id ends with the model's id
    (still unique per conversation and call), which the template renders as the model wrote
    it."""
    from specedge.runtime.chat_template import ChatTemplate
    from specedge.runtime.openai_responses import tool_calls_json

    reply = '[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
    calls = MISTRAL_CALL_ID.parse(reply).calls
    assert [c.model_id for c in calls] == ["a1b2c3d4e"]
    (entry,) = tool_calls_json(calls, "conversation 1")
    assert entry["id"].startswith("call_") and entry["id"].endswith("a1b2c3d4e")
    assert entry["id"] != tool_calls_json(calls, "conversation 2")[0]["id"]
    assert tool_calls_json(calls, "conversation 1", chunk=True)[0]["id"] == entry["id"]
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [entry]},
               {"role": "tool", "tool_call_id": entry["id"], "content": "sunny"}]
    messages, _ = ToolPlan(MISTRAL_CALL_ID, True).messages(history)
    rendered = ChatTemplate(MISTRAL_V11_TEMPLATE.replace("CALL_ID", CALL_ID)).render(
        messages, add_generation_prompt=False, bos_token="", eos_token="", max_chars=1 << 16)
    assert reply in rendered, rendered
    # an id that is no id (not letters and digits) is not kept
    (odd,) = MISTRAL_CALL_ID.parse('[TOOL_CALLS]f[CALL_ID]a-b c[ARGS]{}').calls
    assert odd.model_id is None and len(tool_calls_json([odd], "k")[0]["id"]) == 29


@pytest.mark.parametrize("fmt", [MISTRAL_ARGS, MISTRAL_CALL_ID], ids=lambda f: f.name)
def test_mistral_v11_calls_through_the_server(pair_copy: Path, fmt: ToolFormat) -> None:
    """The template picks the format; its special tags stay in decoded text; a forced reply
    is calls of a tag, a name, (an id,) [ARGS] and arguments fitting the named tool's schema,
    the same tokens with every drafter; earlier calls render as the template writes them; the
    server returns the calls whole and streamed as target-only decoding finds them."""

    from .test_reasoning import own_tokens

    template = MISTRAL_V11_TEMPLATE.replace("CALL_ID", CALL_ID if fmt.id_tag else "")
    (pair_copy / "chat_template.jinja").write_text(template)
    rehash(pair_copy, "chat_template.jinja")
    tags = own_tokens(pair_copy, fmt.tags, special=True)
    pair = Pair.load(pair_copy)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(TOOLS, "required"))
    assert plan.native and plan.fmt is fmt
    args_tag = tags[fmt.tags.index("[ARGS]")]
    assert pair.tokenizer.decode([tags[0], *pair.tokenizer.encode("f"), args_tag,
                                  *pair.tokenizer.encode("{}")]) == "[TOOL_CALLS]f[ARGS]{}"
    encode = pair.tokenizer.encode
    call_id = [tags[fmt.tags.index("[CALL_ID]")], *encode("a1b2c3d4e")] if fmt.id_tag else []
    as_tokens = [tags[0], *encode("time"), *call_id, args_tag, *encode('{"zone": "UTC"}')]
    assert pair.grammars.state(plan.grammar).allowed_prefix([], as_tokens) == len(as_tokens)
    want = _solo(pair, plan, ASK)
    found = calls_of(fmt, want.text)
    assert found and all(fits(name, arguments) for name, arguments in found), want.text
    ids = plan.prompt_ids(pair.tokenizer, ASK)
    for drafter in ("model", "ngram"):
        got = pair.generate(ids, GenerationConfig(max_new_tokens=512 - len(ids),
                                                  grammar=plan.grammar, drafter=drafter,
                                                  num_draft_tokens=3))
        assert got.tokens == want.tokens, drafter
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    rendered = plan.prompt_text(pair.tokenizer, history)
    assert re.search(r'\[TOOL_CALLS\]weather(\[CALL_ID\]\w{9})?\[ARGS\]\{"city": "Paris"\}',
                     rendered), rendered
    assert _served_calls(pair) == (found, found)
