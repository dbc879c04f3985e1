"""Reasoning models: the thinking split off the answer (`runtime/reasoning`, whole and streamed,
with tool calls read from the answer only), and chat template variables (`chat_template_kwargs`,
e.g. Qwen3's `enable_thinking`), through the real server and the `openai` client."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime.chat_template import template_variables
from specedge.runtime.errors import FieldError, InputError
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.reasoning import THINK, ReasoningFormat, ReasoningStream
from specedge.runtime.reply_reader import ReplyReader
from specedge.runtime.server import ServerOptions, create_app
from specedge.runtime.tool_calls import HERMES
from specedge.runtime.tool_set import Tool

from .test_hardening import pair_copy, rehash
from .test_serve import running
from .test_tools import MISTRAL_V11_TEMPLATE

__all__ = ["pair_copy"]  # a fixture, imported for the tests below

# A Qwen3-style template (written for this test): thinking in <think> tags, `enable_thinking:
# false` closes the block empty in the generation prompt, and `open_thinking` (as the R1
# distills' templates do) leaves it open, so the reply starts inside it.
THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{- message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_thinking is defined and open_thinking %}<think>
{% endif %}{% endif %}"""


def oracle(text: str, inside: bool) -> tuple[str | None, str | None]:
    """The split the module docstring specifies, written directly."""
    body = text.lstrip()
    if not inside and not body.startswith("<think>"):
        return None, body or None
    if not inside:
        text = body[len("<think>"):]
    end = text.find("</think>")
    if end < 0:
        return text.strip() or None, None
    return text[:end].strip() or None, text[end + len("</think>"):].lstrip() or None


def test_the_thinking_is_split_off_the_answer() -> None:
    cases = [("<think>\nplan it\n</think>\n\nThe answer.", False, ("plan it", "The answer.")),
             ("plan it</think>\n\nThe answer.", True, ("plan it", "The answer.")),
             ("The answer.", False, (None, "The answer.")),
             ("  <think>cut off by max_tokens", False, ("cut off by max_tokens", None)),
             ("<think>\n\n</think>\n\nNo thinking.", False, (None, "No thinking.")),
             ("Not <think>at the start</think>", False,
              (None, "Not <think>at the start</think>"))]
    for text, inside, want in cases:
        split = THINK.split(text, inside)
        assert (split.reasoning, split.content) == want == oracle(text, inside), text
    assert THINK.opened_by("<|im_start|>assistant\n<think>\n")
    assert not THINK.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.opened_by("<|im_start|>assistant\n")
    assert ReasoningFormat.for_template(THINKING_TEMPLATE) is THINK
    assert ReasoningFormat.for_template("{{ messages[0].content }}") is None


_PIECES = st.lists(st.sampled_from([
    "<think>", "</think>", "<th", "ink>", "</", "think>", " ", "\n", "\n\n", "plan", "answer",
    "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "<tool_call>\n",
    "\n</tool_call>"]), max_size=10)


@settings(max_examples=400)
@given(pieces=_PIECES, data=st.data(), inside=st.booleans(), tools=st.booleans())
def test_a_streamed_reply_gives_what_the_whole_reply_gives(pieces: list[str], data: Any,
                                                           inside: bool, tools: bool) -> None:
    """Any cut of a reply into deltas: the reasoning, answer and calls given out add up to the
    split of the whole text (the oracle), with the calls read from the answer only."""
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    bounds = sorted({0, len(text), *cuts})
    reader = ReplyReader(HERMES if tools else None, THINK, inside)
    parts = [reader.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    parts.append(reader.finish())
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    calls = [c for p in parts for c in p.calls]
    want_reasoning, want_content = oracle(text, inside)
    assert (reasoning or None) == want_reasoning
    if tools:
        found = HERMES.parse(want_content or "")
        assert ((content or None), tuple(calls)) == (found.content, found.calls)
    else:
        assert (content or None, calls) == (want_content, [])
    stream = ReasoningStream(THINK, inside)
    assert stream.reasoned == inside


def test_template_variables_are_checked() -> None:
    assert template_variables(None) == {}
    assert template_variables({"enable_thinking": False}) == {"enable_thinking": False}
    for value, param in [([1], "chat_template_kwargs"), ({"a b": 1}, "chat_template_kwargs"),
                         ({"messages": []}, "chat_template_kwargs.messages"),
                         ({"tools": []}, "chat_template_kwargs.tools"),
                         ({f"v{i}": i for i in range(40)}, "chat_template_kwargs")]:
        with pytest.raises(FieldError) as info:
            template_variables(value)
        assert info.value.param == param and "\n" not in str(info.value)


@pytest.fixture
def thinking(pair_copy: Path) -> Pair:
    (pair_copy / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    rehash(pair_copy, "chat_template.jinja")
    return Pair.load(pair_copy)


ASK = [{"role": "user", "content": "Why is the sky blue?"}]
# The tiny random model writes what these grammars allow: a thinking block and an answer.
THOUGHT = r"<think>[a-z ]{3,12}</think>[a-z ]{3,12}"
OPENED = r"[a-z ]{3,12}</think>[a-z ]{3,12}"
CALL = (r'<think>[a-z]{2,6}</think><tool_call>\n\{"name": "time", "arguments": '
        r'\{\}\}\n</tool_call>')
CLOCK = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}


def _solo(pair: Pair, messages: list[dict[str, Any]], regex: str,
          variables: dict[str, Any] | None = None, tools: list[Any] | None = None) -> str:
    """Target-only decoding of what the server is sent (the rest of the 512-token context)."""
    from specedge.runtime.grammar import Grammar
    from specedge.runtime.tool_prompt import ToolPlan
    from specedge.runtime.tool_set import ToolSet

    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(tools) if tools else None)
    ids = plan.prompt_ids(pair.tokenizer, messages, variables)
    return pair.generate(ids, GenerationConfig(max_new_tokens=512 - len(ids), drafter="none",
                                               grammar=Grammar("regex", regex))).text


def test_reasoning_through_the_openai_client(thinking: Pair) -> None:
    """Whole and streamed: `reasoning_content` and `content` are the split of the reply that
    target-only decoding gives; `enable_thinking: false` and a prompt that opens the block
    change the prompt as the template says; tool calls are read from the answer. The regexes
    spell the thinking block too (`constrain_thinking`), which steers the random model."""
    import openai

    pair = thinking
    model = pair.manifest.root.name
    with running(create_app(pair, ServerOptions(max_tokens_limit=512,
                                                constrain_thinking=True))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for variables, regex, inside in [(None, THOUGHT, False),
                                         ({"open_thinking": True}, OPENED, True)]:
            text = _solo(pair, ASK, regex, variables)
            want = THINK.split(text, inside)
            assert want.reasoning and want.content  # the grammar made both
            extra: dict[str, Any] = {"structured_outputs": {"regex": regex}}
            if variables:
                extra["chat_template_kwargs"] = variables
            reply = client.chat.completions.create(model=model, messages=ASK, temperature=0,
                                                   extra_body=extra)
            message = reply.choices[0].message
            assert (message.content, message.model_extra["reasoning_content"]) == \
                (want.content, want.reasoning)
            assert reply.usage is not None and reply.usage.prompt_tokens == len(
                pair.tokenizer.encode_chat(ASK, variables=variables))
            chunks = list(client.chat.completions.create(
                model=model, messages=ASK, temperature=0, stream=True, extra_body=extra))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.content or "" for d in deltas) == want.content
            assert "".join((d.model_extra or {}).get("reasoning_content") or ""
                           for d in deltas) == want.reasoning
        closed = client.chat.completions.create(
            model=model, messages=ASK, temperature=0, max_tokens=4,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert closed.usage is not None and closed.usage.prompt_tokens == len(
            pair.tokenizer.encode_chat(ASK, variables={"enable_thinking": False}))
        assert closed.usage.prompt_tokens > len(pair.tokenizer.encode_chat(ASK))
        counted = httpx.post(url + "/tokenize", timeout=30, json={
            "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert counted["count"] == closed.usage.prompt_tokens
        text = _solo(pair, ASK, CALL, tools=[CLOCK])
        called = client.chat.completions.create(
            model=model, messages=ASK, temperature=0, tools=[CLOCK],  # type: ignore[list-item]
            extra_body={"structured_outputs": {"regex": CALL}})
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls or []] == ["time"]
        assert choice.message.model_extra["reasoning_content"] == THINK.split(text).reasoning
        # The reply's reasoning goes back in the conversation, as clients send it.
        history = [*ASK, {"role": "assistant", "content": "blue light",
                          "reasoning_content": "scattering"},
                   {"role": "user", "content": "More?"}]
        again = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": history, "max_tokens": 2}).json()
        assert again["usage"]["prompt_tokens"] == len(pair.tokenizer.encode_chat(history))
        assert "scattering" in pair.tokenizer.render_chat(history)


def test_reasoning_format_none_leaves_the_thinking_in_the_content(thinking: Pair) -> None:
    text = _solo(thinking, ASK, THOUGHT)
    options = ServerOptions(reasoning_format="none",
                            template_variables={"enable_thinking": True})
    with running(create_app(thinking, options)) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": thinking.manifest.root.name, "messages": ASK, "temperature": 0,
            "structured_outputs": {"regex": THOUGHT}}).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == text and "reasoning_content" not in message


def test_template_variable_errors_are_400s(thinking: Pair) -> None:
    model = thinking.manifest.root.name
    with running(create_app(thinking, ServerOptions())) as url:
        for route, body, param in [
                ("chat", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                ("chat", {"chat_template_kwargs": {"messages": []}},
                 "chat_template_kwargs.messages"),
                ("completions", {"prompt": "Hi", "chat_template_kwargs": {}},
                 "chat_template_kwargs")]:
            payload = {"model": model, "max_tokens": 2, **(
                {"messages": ASK} if route == "chat" else {}), **body}
            response = httpx.post(f"{url}/v1/{route.replace('chat', 'chat/completions')}",
                                  json=payload, timeout=30)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "\n" not in error["message"]
    with pytest.raises(InputError, match="--chat-template-kwargs.tools"):
        ServerOptions(template_variables={"tools": []})
    with pytest.raises(InputError, match="reasoning_format"):
        ServerOptions(reasoning_format="deepseek")


def test_a_plain_model_is_not_read_for_reasoning(tiny_pair: Pair) -> None:
    """The fixtures' template writes no thinking block: replies are returned as they are."""
    with running(create_app(tiny_pair, ServerOptions())) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": tiny_pair.manifest.root.name, "messages": ASK, "max_tokens": 8,
            "temperature": 0}).json()
    message = reply["choices"][0]["message"]
    want = tiny_pair.generate(ASK, GenerationConfig(max_new_tokens=8, drafter="none")).text
    assert message["content"] == want and "reasoning_content" not in message
    assert json.dumps(reply)  # plain JSON



def test_template_variables_from_the_command_line(thinking: Pair) -> None:
    """`generate --chat --chat-template-kwargs JSON` renders the prompt with them (and so
    does `Pair.template_variables` in Python); bad ones are one-line errors."""
    from click.testing import CliRunner

    from .test_cli import assert_clean_error, generate_json, invoke

    runner = CliRunner()
    root = thinking.manifest.root
    off = {"enable_thinking": False}
    out = generate_json(runner, root, "Hi", "--chat", "--max-new-tokens", "3",
                        "--chat-template-kwargs", json.dumps(off))
    ids = thinking.tokenizer.encode_chat([{"role": "user", "content": "Hi"}], variables=off)
    assert out["stats"]["prompt_tokens"] == len(ids)
    thinking.template_variables = off
    assert thinking.encode_prompt("Hi", chat=True) == ids
    for value, message in (("{", "not JSON"), ("[1]", "--chat-template-kwargs"),
                           ('{"messages": 1}', "--chat-template-kwargs.messages")):
        assert_clean_error(invoke(runner, "generate", root, "Hi", "--chat",
                                  "--chat-template-kwargs", value), message)


# ===================================================== structured output after the thinking

ANSWER = r"[a-z ]{3,12}"  # what the answer must match in the tests below
QUESTIONS = ("Why is the sky blue?", "Hi", "Tell me a story.", "What is 2+2?", "Name a colour.")
CHOICE = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
          "additionalProperties": False}


def own_tokens(folder: Path, texts: tuple[str, ...], special: bool = False) -> list[int]:
    """Make the tiny tokenizer's last BPE tokens `texts`, tokens of their own as in Qwen3's
    tokenizer (added tokens, not special; or `special`, as some tokenizers mark them), and
    return their ids."""
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    ids = sorted(vocab.values())[-len(texts):]
    names = {i: text for text, i in vocab.items() if i in ids}
    for i in ids:
        del vocab[names[i]]
    doc["model"]["merges"] = [m for m in doc["model"]["merges"]
                              if "".join(m.split(" ") if isinstance(m, str) else m)
                              not in names.values()]
    for i, text in zip(ids, texts, strict=True):
        doc["added_tokens"].append({"id": i, "content": text, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": special})
    path.write_text(json.dumps(doc))
    rehash(folder, "tokenizer.json")
    return ids


def think_tokens(folder: Path, special: bool = False) -> tuple[int, int]:
    """`<think>` and `</think>` as tokens of their own (`own_tokens`), and their ids."""
    opening, closing = own_tokens(folder, (THINK.open_tag, THINK.close_tag), special)
    return opening, closing


def _tagged(pair: Pair, text: str, tags: tuple[int, int] | None) -> list[int]:
    """`text`'s tokens, its think tags as the tokens `tags` (None: as text)."""
    if tags is None:
        return pair.tokenizer.encode(text)
    out: list[int] = []
    marked = text.replace("</think>", "\0c\0").replace("<think>", "\0o\0")
    for i, piece in enumerate(marked.split("\0")):
        out += [tags["oc".index(piece)]] if i % 2 else pair.tokenizer.encode(piece)
    return out


def test_a_grammar_after_the_thinking_leaves_the_thinking_free(tiny_pair: Pair,
                                                               pair_copy: Path) -> None:
    """The matcher of a grammar after a thinking block, on tags written in text (the tiny
    tokenizer) and on tags that are tokens of their own: any thinking, then the answer the
    grammar allows; the prompt may have opened the block; a reply may answer straight away."""
    from specedge.runtime.grammar import Grammar
    from specedge.runtime.reasoning import Thinking

    opening, closing = think_tokens(pair_copy)
    own = Pair.load(pair_copy)
    for pair, tags in ((tiny_pair, None), (own, (opening, closing))):
        cases = [("<think>Plan: {x}, 42!</think>\n\nblue sky", False, True),
                 ("blue sky", False, True),
                 ("Plan: {x}!</think> blue sky", True, True),
                 ("<think>Plan</think>Blue!", False, False),  # the answer breaks the grammar
                 ("Plan!", False, False),  # no block: the reply is the answer
                 ("<think>a</think>b</think>c", False, False)]  # the first close ends it
        for text, inside, valid in cases:
            state = pair.grammars.state(Grammar("regex", ANSWER).after(Thinking(THINK, inside)))
            ids = _tagged(pair, text, tags)
            assert (state.allowed_prefix([], ids) == len(ids)) is valid, (text, tags)
        forced = HERMES.grammar([Tool("time", "", '{"type": "object"}')], parallel=False)
        for text, valid in (('<think>now?</think>\n<tool_call>\n{"name": "time", '
                             '"arguments": {}}\n</tool_call>', True),
                            ("<think>now?</think>\nIt is noon.", False)):
            state = pair.grammars.state(forced.after(Thinking(THINK)))
            ids = _tagged(pair, text, tags)
            assert (state.allowed_prefix([], ids) == len(ids)) is valid, (text, tags)
        if tags:  # the thinking may not spell the close tag in text (split would end there)
            state = own.grammars.state(Grammar("regex", ANSWER).after(Thinking(THINK, True)))
            ids = [*own.tokenizer.encode("a</think>"), closing, *own.tokenizer.encode("blue")]
            assert state.allowed_prefix([], ids) < len(ids)


@pytest.fixture(params=[False, True], ids=["added", "special"])
def thinking_tokens(pair_copy: Path, request: pytest.FixtureRequest) -> tuple[Pair, int, int]:
    """A reasoning pair whose tags are tokens of their own (marked special or not: decoded
    text keeps them either way), with its ids of the two tags."""
    (pair_copy / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    rehash(pair_copy, "chat_template.jinja")
    opening, closing = think_tokens(pair_copy, special=request.param)
    return Pair.load(pair_copy), opening, closing


def _steered(thinking: tuple[Pair, int, int], grammar: Any, variables: dict[str, Any],
             inside: bool) -> tuple[list[dict[str, str]], dict[int, float], Any]:
    """A question, and a logit bias on the think tags, whose greedy target-only reply with
    `grammar` after the thinking (the prompt rendered with `variables`; `inside`: it opens the
    block) thinks and then answers: (messages, biases, the reply's split). The random model
    thinks on to the token budget unbiased; this takes the first question and least bias on
    the close tag that end the thinking after some of it."""
    from specedge.runtime.reasoning import Thinking
    from specedge.runtime.sampling import SamplingParams

    pair, opening, closing = thinking
    config = GenerationConfig(max_new_tokens=48, drafter="none",
                              grammar=grammar.after(Thinking(THINK, inside)))
    for question, bias in itertools.product(QUESTIONS, [x / 4 for x in range(24)]):
        messages = [{"role": "user", "content": question}]
        biases = {opening: 50.0, closing: bias}
        ids = pair.tokenizer.encode_chat(messages, variables=variables)
        want = THINK.split(pair.generate(ids, replace(config, sampling=SamplingParams(
            temperature=0, logit_bias=biases))).text, inside)
        if want.reasoning and want.content:
            return messages, biases, want
    raise AssertionError(f"no question and bias made the model think, then answer {variables}")


def test_structured_output_constrains_the_answer_not_the_thinking(
        thinking_tokens: tuple[Pair, int, int]) -> None:
    """Through the server (speculative, greedy): `response_format` and `structured_outputs`
    hold for the answer after the thinking, which stays free, as target-only decoding with
    the grammar after the thinking gives token for token; `serve --constrain-thinking` puts
    the grammar on the whole reply. A logit bias on the tags steers the random model into
    thinking and out of it."""
    from specedge.runtime.grammar import Grammar

    pair, opening, closing = thinking_tokens
    model = pair.manifest.root.name
    text = pair.tokenizer.decode([opening, *pair.tokenizer.encode("hm"), closing])
    assert text == "<think>hm</think>"  # the tags stay in the text, special or not
    cases = [({"open_thinking": True}, True, {"structured_outputs": {"regex": ANSWER}},
              Grammar("regex", ANSWER)),
             ({}, False, {"response_format": {"type": "json_schema", "json_schema": {
                 "name": "choice", "schema": CHOICE}}}, Grammar.json_schema(CHOICE))]
    with running(create_app(pair, ServerOptions(max_tokens_limit=48))) as url:
        for variables, inside, field, grammar in cases:
            messages, biases, want = _steered(thinking_tokens, grammar, variables, inside)
            reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": model, "messages": messages, "temperature": 0, "max_tokens": 48,
                "logit_bias": {str(t): b for t, b in biases.items()},
                "chat_template_kwargs": variables, **field}).json()
            message = reply["choices"][0]["message"]
            assert (message.get("reasoning_content"), message["content"]) == \
                (want.reasoning, want.content), (variables, reply)
            if inside:
                assert re.fullmatch(ANSWER, want.content)
                assert not re.fullmatch(ANSWER, want.reasoning)  # the thinking was free
            else:
                assert json.loads(want.content)["a"] in ("x", "y")
    with running(create_app(pair, ServerOptions(max_tokens_limit=48,
                                                constrain_thinking=True))) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": ASK, "temperature": 0, "max_tokens": 48,
            "chat_template_kwargs": {"open_thinking": True},
            "structured_outputs": {"regex": ANSWER}}).json()
    message = reply["choices"][0]["message"]  # the whole reply matched: all thinking
    assert message["content"] is None and re.fullmatch(ANSWER, message["reasoning_content"])


def test_a_chat_the_pair_renders_keeps_the_thinking_free_as_the_server_does(
        thinking_tokens: tuple[Pair, int, int], concat_dir: Path, tmp_path: Path) -> None:
    """`Pair.generate`/`stream`/`generate_batch` with messages (or a str with `chat`) and
    `generate --chat` put a grammar after a reasoning model's thinking, as the server does
    (before, the grammar held from the reply's first token and the model could not think):
    greedy speculative output equals target-only decoding with the grammar after the
    thinking, token for token; `constrain_thinking` (`--constrain-thinking`) puts it on the
    whole reply; a prompt of token ids keeps the grammar as given. `--json` gives the thinking
    and the answer apart (and `--tools` the calls read from the answer), as the server does."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.runtime.grammar import Grammar
    from specedge.runtime.reasoning import Thinking
    from specedge.runtime.sampling import SamplingParams
    from specedge.runtime.serving import ContinuousBatch
    from specedge.runtime.tool_prompt import ToolPlan
    from specedge.runtime.tool_set import ToolSet

    from .test_cli import generate_json
    from .test_hardening import copy_pair

    pair = thinking_tokens[0]
    grammar = Grammar("regex", ANSWER)
    messages, biases, want = _steered(thinking_tokens, grammar, {}, False)
    config = GenerationConfig(max_new_tokens=48, grammar=grammar, sampling=SamplingParams(
        temperature=0, logit_bias=biases))
    for drafter in ("model", "ngram"):
        spec = replace(config, drafter=drafter)
        got = pair.generate(messages, spec)
        assert THINK.split(got.text) == want, drafter
        assert THINK.split("".join(pair.stream(messages, spec))) == want
        assert pair.generate(messages[0]["content"], replace(spec, chat=True)).tokens == \
            got.tokens
    concat = copy_pair(concat_dir, tmp_path / "concat")  # batches: the concat graph form
    (concat / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    rehash(concat, "chat_template.jinja")
    assert think_tokens(concat) == thinking_tokens[1:]  # the same tokenizer's ids
    batched = Pair.load(concat)
    rows = [messages, [{"role": "user", "content": QUESTIONS[-1]}]]
    solo = [batched.generate(m, replace(config, drafter="none")) for m in rows]
    batch = batched.generate_batch(rows, replace(config, drafter="model"))
    assert [r.tokens for r in batch.results] == [r.tokens for r in solo]
    server = ContinuousBatch(batched, capacity=2, drafter="model")
    ids = [server.submit(m, config) for m in rows]
    done = server.run()
    assert [done[i].tokens for i in ids] == [r.tokens for r in solo]
    assert THINK.split(solo[0].text).reasoning  # the rows thought
    rows_file = tmp_path / "rows.jsonl"  # `generate --batch --json`: each row read apart
    rows_file.write_text("".join(json.dumps({
        "messages": m, "max_new_tokens": 48, "logit_bias": {str(t): b for t, b in biases.items()},
        "structured_outputs": {"regex": ANSWER}}) + "\n" for m in rows))
    printed = CliRunner().invoke(main, ["generate", str(concat), "--batch", str(rows_file),
                                        "--json"])
    assert printed.exit_code == 0, printed.output
    got_rows = [json.loads(line) for line in printed.stdout.splitlines()][:-1]
    assert [(r["reasoning"], r["content"]) for r in got_rows] == [
        (split.reasoning, split.content) for split in (THINK.split(r.text) for r in solo)]
    whole = pair.generate(messages, replace(config, constrain_thinking=True))
    assert re.fullmatch(ANSWER, whole.text)  # no thinking: the grammar held from the start
    ids = pair.tokenizer.encode_chat(messages)
    assert pair.generate(ids, config).tokens == whole.tokens  # ids: the grammar as given
    bias_args = [a for t, b in biases.items() for a in ("--logit-bias", f"{t}={b}")]
    args = [messages[0]["content"], "--chat", "--regex", ANSWER, "--max-new-tokens", "48",
            *bias_args]
    folder = pair.manifest.root
    out = generate_json(CliRunner(), folder, *args)
    assert THINK.split(out["text"]) == want
    assert (out["reasoning"], out["content"]) == (want.reasoning, want.content)  # as serve's
    tools_file = tmp_path / "tools.json"  # a forced call after the same free thinking
    tools_file.write_text(json.dumps([CLOCK]))
    called = generate_json(CliRunner(), folder, messages[0]["content"], "--tools",
                           str(tools_file), "--tool-choice", "time", "--max-new-tokens", "200",
                           *bias_args)
    # `chat`: the thinking shown before the answer, and kept in the history as clients send it
    # back (`reasoning_content`): the second turn is the pair's reply to that conversation.
    again = "Name a colour."
    talk = CliRunner().invoke(main, ["chat", str(folder), "--regex", ANSWER,
                                     "--max-new-tokens", "48", *bias_args],
                              input=f"{messages[0]['content']}\n{again}\n")
    assert talk.exit_code == 0, talk.output
    history = [*messages, {"role": "assistant", "content": want.content,
                           "reasoning_content": want.reasoning},
               {"role": "user", "content": again}]
    second = THINK.split(pair.generate(history, config).text)
    ahead = pair.conversation_ids(messages, history[1])  # what `chat` prefills while you read
    assert pair.encode_prompt(history)[:len(ahead)] == ahead
    shown = [want, second]  # each reply: its thinking, then the answer on a line of its own
    assert talk.stdout == "> " + "".join(
        (split.reasoning or "") + ("\n\n" if split.reasoning and split.content else "")
        + (split.content or "") + "\n> " for split in shown)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai(
        [CLOCK], {"type": "function", "function": {"name": "time"}}))
    assert plan.grammar is not None
    solo = pair.generate(pair.tokenizer.encode_rendered(plan.prompt_text(
        pair.tokenizer, messages)), replace(config, max_new_tokens=200, drafter="none",
                                            grammar=plan.grammar.after(Thinking(THINK))))
    read = ReplyReader(plan.fmt, THINK).read(solo.text)
    assert called["tokens"] == solo.tokens and read.reasoning and read.calls
    assert (called["reasoning"], called["content"]) == (read.reasoning, None)
    assert [c["name"] for c in called["tool_calls"]] == ["time"]
    assert generate_json(CliRunner(), folder, *args, "--constrain-thinking")["tokens"] == \
        whole.tokens


# A Magistral-style template: the system prompt names the [THINK] and [/THINK] tags, calls are
# written as Mistral's v11+ tokenizers write them (test_tools' template).
MAGISTRAL_TEMPLATE = "[SYSTEM_PROMPT]Think first, between [THINK] and [/THINK], then answer." \
    "[/SYSTEM_PROMPT]\n" + MISTRAL_V11_TEMPLATE.replace("CALL_ID", "")

def test_magistral_thinking_and_calls_through_the_server(pair_copy: Path) -> None:
    """[THINK] ... [/THINK] (special tokens, kept in decoded text) is read as reasoning and
    the `[TOOL_CALLS]name[ARGS]{...}` call after it as a call, whole and streamed, as
    target-only decoding with the forced call's grammar after the thinking finds them. A
    logit bias on the tags steers the random model into thinking and out of it."""
    import openai

    from specedge.runtime.reasoning import MISTRAL_THINK, Thinking
    from specedge.runtime.sampling import SamplingParams
    from specedge.runtime.tool_calls import MISTRAL_ARGS
    from specedge.runtime.tool_prompt import ToolPlan
    from specedge.runtime.tool_set import ToolSet

    assert ReasoningFormat.for_template(MAGISTRAL_TEMPLATE) is MISTRAL_THINK
    (pair_copy / "chat_template.jinja").write_text(MAGISTRAL_TEMPLATE)
    rehash(pair_copy, "chat_template.jinja")
    tags = ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]")
    opening, closing, *_ = own_tokens(pair_copy, tags, special=True)
    pair = Pair.load(pair_copy)
    assert pair.tokenizer.decode([opening, closing, *_]) == "".join(tags)
    plan = ToolPlan.for_tokenizer(pair.tokenizer, ToolSet.from_openai([CLOCK], "required", False))
    assert plan.fmt is MISTRAL_ARGS and plan.grammar is not None
    ids = plan.prompt_ids(pair.tokenizer, ASK)
    config = GenerationConfig(max_new_tokens=48, drafter="none",
                              grammar=plan.grammar.after(Thinking(MISTRAL_THINK)))
    for bias in [x / 4 for x in range(24)]:  # the least that ends the thinking after some
        biases = {opening: 50.0, closing: bias}
        text = pair.generate(ids, replace(config, sampling=SamplingParams(
            temperature=0, logit_bias=biases))).text
        want = MISTRAL_THINK.split(text)
        if want.reasoning and MISTRAL_ARGS.parse(want.content or "").calls:
            break
    assert want.reasoning and want.content, text
    with running(create_app(pair, ServerOptions(max_tokens_limit=48))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        kwargs: dict[str, Any] = {
            "model": pair.manifest.root.name, "messages": ASK, "temperature": 0,
            "max_tokens": 48, "tools": [CLOCK], "tool_choice": "required",
            "parallel_tool_calls": False,
            "logit_bias": {str(t): b for t, b in biases.items()}}
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, \
            (text, choice)
        assert [c.function.name for c in choice.message.tool_calls or []] == ["time"]
        assert choice.message.model_extra["reasoning_content"] == want.reasoning
        deltas = [c.choices[0].delta for c in client.chat.completions.create(
            stream=True, **kwargs) if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or ""
                       for d in deltas) == want.reasoning
        assert [c.function.name for d in deltas for c in d.tool_calls or []
                if c.function and c.function.name] == ["time"]
