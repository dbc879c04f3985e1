"""A conversation the server rendered (a reasoning model's chat, tools): what the idle server
prefills ahead after a reply is the conversation as a client sends it back (the reply as the
response returned it, rendered by the chat template), so that the next turn reuses all of it,
through a real server and client, on both serving engines."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prefix_cache import PREFILL_CHUNK as C
from specedge.runtime.reasoning import THINK
from specedge.runtime.server import ServerOptions, create_app
from specedge.runtime.tool_prompt import ToolPlan
from specedge.runtime.tool_set import ToolSet

from .test_hardening import copy_pair, rehash
from .test_serve import running
from .test_tools import NATIVE_TEMPLATE

# Written for this test after Qwen3's template: the generation prompt opens the thinking block,
# and an earlier reply is rendered without its thinking (the text after "</think>").
DROPS_THINKING = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == "assistant" %}{{ message.content.split("</think>")[-1].lstrip() }}
{%- else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
# The tiny random model writes what this allows: the rest of a thinking block and an answer.
REPLY = r"[a-z ]{4,12}</think>[a-z]{3}[a-z ]{40,50}[a-z]"


# NATIVE_TEMPLATE, rendering each earlier call's id where the call opens (as Mistral Small
# 3.2's renders `[CALL_ID]` and the id after each call's name).
RENDERS_IDS = NATIVE_TEMPLATE.replace("<tool_call>\n{{", '<tool_call id="{{ call.id }}">\n{{')
# One short tool, so that the conversation fits the tiny models' context.
CLOCK = [{"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}]
ID = "call_" + "0" * 24  # as long as the ids the server returns
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": ID, "type": "function", "function": {"name": "now", "arguments": "{}"}}]}


def _padded(fits: Any) -> list[dict[str, Any]]:
    """A first turn that `fits` (its messages: whether they end where the test needs)."""
    for n in range(400):
        messages = [{"role": "system", "content": "You are helpful." + " Be brief." * n},
                    {"role": "user", "content": "Weather in Paris?"}]
        if fits(messages):
            return messages
    raise AssertionError("no padding puts the prompt where the test needs it")


def _before_a_chunk_end(pair: Pair) -> Any:
    """A prompt ending a few tokens before a prefill chunk's end, so that only a reply kept in
    the conversation fills that chunk."""
    return lambda messages: C - 8 <= len(pair.tokenizer.encode_chat(messages)) % C <= C - 2


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_the_next_turn_reuses_the_reply_as_the_template_renders_it(
        fixture: str, fixtures_dir: Path, tmp_path: Path) -> None:
    folder = copy_pair(fixtures_dir / fixture, tmp_path / fixture)
    (folder / "chat_template.jinja").write_text(DROPS_THINKING)
    rehash(folder, "chat_template.jinja")
    pair, cold = Pair.load(folder, prefix_cache=1), Pair.load(folder)
    tokenizer = pair.tokenizer
    history = _padded(_before_a_chunk_end(pair))
    first = tokenizer.encode_chat(history)
    options = ServerOptions(max_tokens_limit=256, warmup_tokens=0, constrain_thinking=True,
                            max_batch=2)
    with running(create_app(pair, options)) as url:
        def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            response = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": folder.name, "messages": messages, "temperature": 0, **extra})
            assert response.status_code == 200, response.text
            return response.json()

        reply = chat(history, structured_outputs={"regex": REPLY})
        message = reply["choices"][0]["message"]
        assert message["content"] and message["reasoning_content"]  # the grammar made both
        history += [message, {"role": "user", "content": "And then?"}]  # sent back as returned
        again = chat(history, max_tokens=6)
        # A reply cut off inside its thinking has no content (null); sent back, it is taken.
        cut = again["choices"][0]["message"]
        assert cut["content"] is None and cut["reasoning_content"]
        third = chat([*history, cut, {"role": "user", "content": "Go on."}], max_tokens=2)
    conversation = tokenizer.encode_chat(history[:-1], add_generation_prompt=False)
    second = tokenizer.encode_chat(history)
    common = len(os.path.commonprefix([conversation, second]))
    assert common > len(first) + 10  # the template renders the answer where the reply was
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == common // C * C > len(first) // C * C  # the answer's chunk was ahead
    solo = cold.generate(second, GenerationConfig(max_new_tokens=6, drafter="none")).text
    assert cut["reasoning_content"] == THINK.split(solo, inside=True).reasoning
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-llama-concat"])
def test_the_next_turn_reuses_calls_whose_ids_the_template_renders(
        fixture: str, fixtures_dir: Path, tmp_path: Path) -> None:
    """The ids a reply's calls are returned with are the ones the conversation prefilled ahead
    renders (before, each got a new random id twice: the prefilled conversation left the
    client's at the first id), and the same in a stream."""
    folder = copy_pair(fixtures_dir / fixture, tmp_path / fixture)
    (folder / "chat_template.jinja").write_text(RENDERS_IDS)
    rehash(folder, "chat_template.jinja")
    pair = Pair.load(folder, prefix_cache=1)
    tokenizer = pair.tokenizer
    tools = ToolSet.from_openai(CLOCK, "required")

    plan = ToolPlan.for_tokenizer(tokenizer, tools)

    def text(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return plan.prompt_text(tokenizer, messages, add_generation_prompt=add_generation_prompt)

    def ids(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return tokenizer.encode_rendered(text(messages, add_generation_prompt))

    def id_then_chunk_end(messages: list[dict[str, Any]]) -> bool:
        """A prefill chunk ends between the reply's call id and the conversation's end."""
        called = text([*messages, CALLED], add_generation_prompt=False)
        upto_id = tokenizer.encode_rendered(called[:called.index(ID) + len(ID)])
        end = len(ids([*messages, CALLED], add_generation_prompt=False))
        return len(upto_id) < (len(ids(messages)) // C + 1) * C < end - 4

    history = _padded(id_then_chunk_end)
    first = ids(history)
    options = ServerOptions(max_tokens_limit=256, warmup_tokens=0, max_batch=2)
    with running(create_app(pair, options)) as url:
        def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            response = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "model": folder.name, "messages": messages, "tools": CLOCK,
                "temperature": 0, **extra})
            assert response.status_code == 200, response.text
            return response.json()

        message = chat(history, tool_choice="required")["choices"][0]["message"]
        assert message["tool_calls"]
        streamed = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": folder.name, "messages": history, "tools": CLOCK, "temperature": 0,
            "tool_choice": "required", "stream": True}).text
        assert all(c["id"] in streamed for c in message["tool_calls"])  # the same ids
        history += [message, *({"role": "tool", "tool_call_id": c["id"], "content": "12:00"}
                               for c in message["tool_calls"])]
        again = chat(history, max_tokens=2)
    conversation, second = ids(history[:len(history) - len(message["tool_calls"])],
                               add_generation_prompt=False), ids(history)
    common = len(os.path.commonprefix([conversation, second]))
    assert common > len(first) + 20  # the calls, ids and all, as the client sent them back
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == common // C * C > len(first) // C * C
