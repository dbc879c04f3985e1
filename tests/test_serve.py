"""`specedge serve`: a real uvicorn server on 127.0.0.1 and real clients (`openai`, httpx).

Both graph forms: the concat tiny pair (continuous batching) and the gqa-shared tiny pair
(batch-1 FIFO). Greedy responses equal `Pair.generate` with the same settings (what
`specedge generate` prints); seeded ones equal their solo run whatever else is running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from specedge.runtime import server_http as server_http_module
from specedge.runtime.errors import InputError
from specedge.runtime.grammar import Grammar
from specedge.runtime.openai_api import RequestDefaults, parse_request
from specedge.runtime.openai_responses import finish_reason
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.server import ServerOptions, create_app

from .test_hardening import pair_copy, rehash

__all__ = ["pair_copy"]  # a fixture, imported for the tests below

ROOT = Path(__file__).resolve().parents[1]
FORMS = {"gqa": "tiny-llama", "concat": "tiny-llama-concat"}
PROMPTS = ["Hello there", "The quick brown fox", "def add(a, b):", "Once upon a time",
           "Write a haiku about the sea.", "1, 2, 3, 4,", "The capital of France is", "Hi"]
BODY_LIMIT = 64 * 1024


@dataclass
class Served:
    pair: Pair
    url: str
    app: Any

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=60, **kwargs)

    @property
    def model(self) -> str:
        return str(self.app.state.scheduler.pair.manifest.root.name)


@contextmanager
def running(app: Any, http: Any = "auto") -> Iterator[str]:
    """Run `app` under uvicorn (`http`: its HTTP protocol) on a free 127.0.0.1 port in a thread;
    yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", http=http))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@pytest.fixture(scope="module")
def pairs(fixtures_dir: Path) -> dict[str, Pair]:
    return {form: Pair.load(fixtures_dir / name) for form, name in FORMS.items()}


@pytest.fixture(scope="module", params=list(FORMS))
def served(request: pytest.FixtureRequest, pairs: dict[str, Pair]) -> Iterator[Served]:
    pair = pairs[request.param]
    app = create_app(pair, ServerOptions(max_batch=4, max_queue=16, max_tokens_limit=480,
                                         max_body_bytes=BODY_LIMIT))
    with running(app) as url:
        yield Served(pair, url, app)


def solo(pair: Pair, prompt: Any, max_tokens: int, temperature: float = 0.0,
         seed: int | None = None, stop: tuple[str, ...] = (), chat: bool = True) -> Any:
    """What `specedge generate --no-speculation [--chat]` gives with these settings: the
    target's own decoding, which the speculative server must reproduce (seeded sampling is
    position-keyed, so seeded rows match it too)."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    return pair.generate(prompt, GenerationConfig(max_new_tokens=max_tokens, sampling=sampling,
                                                  stop=stop, chat=chat, drafter="none"))


def capture_jobs(app: Any) -> list[Any]:
    """Record the scheduler's jobs as they are submitted."""
    scheduler, jobs = app.state.scheduler, []
    submit = scheduler.submit

    def recording(*args: Any, **kwargs: Any) -> Any:
        job = submit(*args, **kwargs)
        jobs.append(job)
        return job

    scheduler.submit = recording
    return jobs


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# ------------------------------------------------------------------------------- the openai client


def test_openai_client_equals_generate(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    messages = [{"role": "user", "content": "Hello there"}]
    want = solo(pair, "Hello there", 24)
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                           temperature=0)
    assert reply.choices[0].message.content == want.text
    assert reply.choices[0].finish_reason == finish_reason(want.stop_reason) == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(want.prompt_tokens), len(want.tokens))
    assert 0.0 <= reply.usage.model_extra["specedge"]["acceptance_rate"] <= 1.0
    spec = reply.usage.model_extra["specedge"]
    assert spec["proposed"] > 0 and spec["accepted"] > 0  # it speculated, and matched anyway

    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24

    plain = solo(pair, "The quick brown fox", 16, chat=False)
    done = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16,
                                     temperature=0)
    assert done.choices[0].text == plain.text
    streamed = client.completions.create(model=model, prompt="The quick brown fox",
                                         max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.text


def test_logprobs_through_the_openai_client(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    token_bytes = pair.tokenizer.token_bytes
    messages = [{"role": "user", "content": "Hello there"}]
    want = pair.generate("Hello there", GenerationConfig(max_new_tokens=20, chat=True,
                                                         logprobs=3, drafter="none"))
    assert want.logprobs is not None
    wanted = [(token_bytes(e.token), e.logprob, [token_bytes(t) for t, _ in e.top])
              for e in want.logprobs]

    def close(got: list[tuple[bytes, float, list[bytes]]]) -> None:
        assert [(b, top) for b, _, top in got] == [(b, top) for b, _, top in wanted]
        np.testing.assert_allclose([lp for _, lp, _ in got], [lp for _, lp, _ in wanted],
                                   atol=1e-4)

    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=20,
                                           temperature=0, logprobs=True, top_logprobs=3)
    assert reply.choices[0].message.content == want.text
    assert reply.usage is not None and reply.usage.model_extra["specedge"]["proposed"] > 0
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(want.tokens)
    close([(bytes(i.bytes), i.logprob, [bytes(t.bytes) for t in i.top_logprobs])
           for i in content])
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0, logprobs=True,
        top_logprobs=3, stream=True))
    close([(bytes(i.bytes), i.logprob, [bytes(t.bytes) for t in i.top_logprobs])
           for c in chunks if c.choices and c.choices[0].logprobs
           for i in c.choices[0].logprobs.content])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text

    plain = pair.generate("The quick brown fox", GenerationConfig(max_new_tokens=16, logprobs=2,
                                                                  drafter="none"))
    assert plain.logprobs is not None
    done = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=16,
                                     temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and done.choices[0].text == plain.text
    texts = [token_bytes(e.token).decode("utf-8", errors="replace") for e in plain.logprobs]
    assert lp.tokens == texts
    np.testing.assert_allclose(lp.token_logprobs, [e.logprob for e in plain.logprobs],
                               atol=1e-4)
    assert all(len(top) >= 2 for top in lp.top_logprobs)  # the top 2 (and the chosen token)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=16, temperature=0, logprobs=2,
        stream=True) if c.choices[0].logprobs]
    assert [t for part in streamed for t in part.tokens] == texts
    offsets = [o for part in streamed for o in part.text_offset]
    assert offsets == lp.text_offset and offsets == sorted(offsets) and offsets[0] == 0
    none = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    assert none.choices[0].logprobs is None


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(served: Served) -> None:
    """lm-evaluation-harness's loglikelihood request: the context and continuation as one
    prompt, echo, logprobs=1, max_tokens=1, temperature 0; it reads the prompt's
    token_logprobs and whether each token was the top one."""
    client, pair, model = served.client(), served.pair, served.model
    prompt = "The capital of France is Paris"
    ids = pair.encode_prompt(prompt)
    scored = pair.prompt_logprobs(ids, 1)
    after = pair.generate(prompt, GenerationConfig(max_new_tokens=1, logprobs=1,
                                                   drafter="none"))
    assert after.logprobs is not None
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, logprobs=1,
                                      echo=True, temperature=0)
    choice = reply.choices[0]
    assert choice.text == prompt + after.text
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:],
                               [e.logprob for e in scored + after.logprobs], atol=1e-4)
    token_text = [pair.tokenizer.token_bytes(t).decode("utf-8", errors="replace")
                  for t in [*ids, *after.tokens]]
    assert lp.tokens == token_text
    assert lp.text_offset == [len("".join(token_text[:i])) for i in range(len(token_text))]
    for e, top in zip(scored, lp.top_logprobs[1:], strict=False):
        is_greedy = max(top.values()) <= e.logprob + 1e-9  # what the harness checks
        assert is_greedy == (e.top[0][0] == e.token)
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                              logprobs=1, echo=True, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True,
                                      temperature=0)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    # The harness's default: the prompt as token ids, a list of one (and the ids alone).
    for ids_prompt in ([ids], ids):
        by_ids = client.completions.create(model=model, prompt=ids_prompt, max_tokens=1,
                                           logprobs=1, echo=True, temperature=0)
        assert by_ids.choices[0].text == pair.tokenizer.decode(
            ids, skip_special_tokens=False) + after.text
        assert by_ids.choices[0].logprobs is not None
        assert by_ids.choices[0].logprobs.tokens == lp.tokens
        np.testing.assert_allclose(by_ids.choices[0].logprobs.token_logprobs[1:],
                                   lp.token_logprobs[1:], atol=1e-6)


def test_several_prompts_in_one_completions_request(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    ids = pair.encode_prompt("Once upon a time")
    prompts: list[Any] = ["The quick brown fox", ids, "def add(a, b):"]
    want = [solo(pair, p, 12, chat=False) for p in prompts]
    reply = client.completions.create(model=model, prompt=prompts, max_tokens=12,
                                      temperature=0, logprobs=1)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, one in zip(reply.choices, want, strict=True):
        assert choice.text == one.text
        assert choice.logprobs is not None and len(choice.logprobs.tokens) == len(one.tokens)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(len(w.tokens) for w in want)
    assert reply.usage.prompt_tokens == sum(len(w.prompt_tokens) for w in want)
    texts = {0: "", 1: "", 2: ""}
    chunks = list(client.completions.create(model=model, prompt=prompts, max_tokens=12,
                                            temperature=0, stream=True, echo=True,
                                            stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    echoed = [prompts[0], pair.tokenizer.decode(ids, skip_special_tokens=False), prompts[2]]
    assert [texts[i] for i in range(3)] == [e + w.text for e, w in zip(echoed, want,
                                                                       strict=True)]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == sum(
        len(w.tokens) for w in want)
    most = served.app.state.scheduler.slots + 16  # --max-batch (1 for a FIFO) + --max-queue
    with httpx.Client(base_url=served.url, timeout=30) as http:
        reply = http.post("/v1/completions", json={"model": model, "prompt": ["Hi"] * (most + 1),
                                                   "max_tokens": 2})
        assert reply.status_code == 400 and f"at most {most}" in reply.json()["error"]["message"]
        reply = http.post("/v1/completions", json={"model": model, "prompt": ["Hi", ""],
                                                   "max_tokens": 2})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


def test_n_choices(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                           temperature=0.9, seed=5, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for j, choice in enumerate(reply.choices):  # choice j samples with seed + j
        want = solo(pair, "Write a haiku about the sea.", 16, temperature=0.9, seed=5 + j)
        assert choice.message.content == want.text
    assert len({c.message.content for c in reply.choices}) > 1
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                                temperature=0.9, seed=5, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in reply.choices]
    both = client.completions.create(model=model, prompt=["Hi", "The quick brown fox"],
                                     max_tokens=6, temperature=0, n=2)
    texts = [c.text for c in both.choices]  # prompt by prompt, n each
    assert texts == [solo(pair, p, 6, chat=False).text for p in ("Hi", "Hi",
                                                                  "The quick brown fox",
                                                                  "The quick brown fox")]


def test_penalties_through_the_openai_client(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    want = pair.generate("a b a b a b", GenerationConfig(max_new_tokens=24, sampling=sampling,
                                                         drafter="none"))
    reply = client.completions.create(model=model, prompt="a b a b a b", max_tokens=24,
                                      temperature=0, presence_penalty=0.5,
                                      frequency_penalty=1.0)
    assert reply.choices[0].text == want.text
    assert reply.usage is not None and reply.usage.model_extra["specedge"]["proposed"] > 0
    assert want.text != solo(pair, "a b a b a b", 24, chat=False).text


def test_logit_bias_and_repetition_penalty_through_the_openai_client(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    plain = solo(pair, "a b a b a b", 16, chat=False)
    banned = plain.tokens[0]
    sampling = SamplingParams(repetition_penalty=1.5, logit_bias={banned: -100})
    want = pair.generate("a b a b a b", GenerationConfig(max_new_tokens=16, sampling=sampling,
                                                         drafter="none"))
    reply = client.completions.create(model=model, prompt="a b a b a b", max_tokens=16,
                                      temperature=0, logit_bias={str(banned): -100},
                                      extra_body={"repetition_penalty": 1.5})
    assert reply.choices[0].text == want.text != plain.text
    assert banned not in want.tokens
    assert reply.usage is not None and reply.usage.model_extra["specedge"]["proposed"] > 0


def test_min_tokens_ignore_eos_and_stop_token_ids(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    eos = pair.manifest.eos_token_ids[0]
    early = {"logit_bias": {str(eos): 12}}
    short = client.completions.create(model=model, prompt="Hello there", max_tokens=20,
                                      temperature=0, **early)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    assert short.usage.completion_tokens < 4
    want = pair.generate("Hello there", GenerationConfig(
        max_new_tokens=20, drafter="none",
        sampling=SamplingParams(logit_bias={eos: 12}, min_tokens=7)))
    held = client.completions.create(model=model, prompt="Hello there", max_tokens=20,
                                     temperature=0, extra_body={"min_tokens": 7}, **early)
    assert held.choices[0].text == want.text and held.usage is not None
    assert held.usage.completion_tokens == len(want.tokens) > 7
    full = client.completions.create(model=model, prompt="Hello there", max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True}, **early)
    assert full.choices[0].finish_reason == "length" and full.usage is not None
    assert full.usage.completion_tokens == 20
    free = solo(pair, "Hello there", 12, chat=False)
    cut = client.completions.create(model=model, prompt="Hello there", max_tokens=12,
                                    temperature=0,
                                    extra_body={"stop_token_ids": [free.tokens[4]]})
    assert cut.choices[0].finish_reason == "stop" and cut.usage is not None
    assert cut.usage.completion_tokens == free.tokens.index(free.tokens[4]) + 1


def test_structured_output_through_the_openai_client(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    messages = [{"role": "user", "content": "Answer in JSON"}]
    want = pair.generate(messages, GenerationConfig(max_new_tokens=40, drafter="none",
                                                    grammar=Grammar.json_schema(schema)))
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text and set(json.loads(text)) == {"ok", "n"}
    regex = client.completions.create(model=model, prompt="Hi", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[a-c]{4}!"}})
    assert re.fullmatch("[a-c]{4}!", regex.choices[0].text)
    assert regex.choices[0].finish_reason == "stop"
    choice = client.completions.create(model=model, prompt="Hi", max_tokens=20, temperature=0,
                                       extra_body={"guided_choice": ["north", "south"]})
    assert choice.choices[0].text in ("north", "south")
    anything = client.chat.completions.create(model=model, messages=messages, max_tokens=30,
                                              temperature=0,
                                              response_format={"type": "json_object"})
    content = anything.choices[0].message.content
    assert content is not None and anything.choices[0].finish_reason in ("stop", "length")
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_tokenizer_routes(served: Served) -> None:
    pair, tok = served.pair, served.pair.tokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    with httpx.Client(base_url=served.url, timeout=30) as http:
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
        assert info["model_max_length"] == served.app.state.scheduler.context(GenerationConfig())
        text = "The quick brown fox"
        got = http.post("/tokenize", json={"prompt": text}).json()
        assert got["tokens"] == pair.encode_prompt(text) and got["count"] == len(got["tokens"])
        bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert bare["tokens"] == tok.encode(text)
        chat = http.post("/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == pair.encode_prompt(messages)
        back = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()
        assert back["prompt"] == tok.decode(chat["tokens"], skip_special_tokens=False)
        for path, body, param in (("/tokenize", {}, "prompt"),
                                  ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/tokenize", {"prompt": "a", "add_special_tokens": 1},
                                   "add_special_tokens"),
                                  ("/tokenize", {"messages": [{"role": "robot"}]},
                                   "messages[0].role"),
                                  ("/detokenize", {"tokens": [10**7]}, "tokens"),
                                  ("/detokenize", {"tokens": "12"}, "tokens")):
            reply = http.post(path, json=body)
            assert reply.status_code == 400, (path, body, reply.text)
            assert reply.json()["error"]["param"] == param, (path, body, reply.text)


def test_stop_strings_and_seeded_sampling(served: Served) -> None:
    client, pair, model = served.client(), served.pair, served.model
    full = solo(pair, "Once upon a time", 40).text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    want = solo(pair, "Once upon a time", 40, stop=(stop,))
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=40, temperature=0, stop=stop)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (want.text,
                                                                                   "stop")
    seeded = solo(pair, "Hi", 30, temperature=0.9, seed=11)
    for _ in range(2):
        again = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=30,
            temperature=0.9, seed=11)
        assert again.choices[0].message.content == seeded.text


def test_sixteen_concurrent_streams_equal_solo_runs(served: Served) -> None:
    cases = [(PROMPTS[i % len(PROMPTS)], 8 + 5 * i, 0.0 if i % 2 else 0.8, i)
             for i in range(16)]

    async def one(client: openai.AsyncOpenAI, case: tuple[str, int, float, int]) -> str:
        prompt, n, temperature, seed = case
        stream = await client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": prompt}], max_tokens=n,
            temperature=temperature, seed=seed, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, c) for c in cases))

    proposed = _metric(served, "specedge_draft_tokens_proposed_total")
    accepted = _metric(served, "specedge_draft_tokens_accepted_total")
    got = asyncio.run(main())
    # The streams drafted (a concat server's continuous batch proposed none before the tests
    # scripted adaptive K: its real tuner settled on k = 0) and still equal target-only.
    assert _metric(served, "specedge_draft_tokens_proposed_total") > proposed
    assert _metric(served, "specedge_draft_tokens_accepted_total") > accepted
    for (prompt, n, temperature, seed), text in zip(cases, got, strict=True):
        assert text == solo(served.pair, prompt, n, temperature, seed).text, (prompt, n)
    scheduler = served.app.state.scheduler
    if scheduler.batched:  # requests shared rounds, joining and leaving the running batch
        assert max(scheduler.engine.batch.decoder.totals.live_rows) == 4


# ------------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("form", list(FORMS))
def test_disconnect_frees_the_slot_within_a_round(pairs: dict[str, Pair], form: str) -> None:
    pair = pairs[form]
    app = create_app(pair, ServerOptions(max_batch=1, max_queue=4, max_tokens_limit=480))
    jobs = capture_jobs(app)
    body = {"model": pair.manifest.root.name, "prompt": "Hello", "max_tokens": 480,
            "temperature": 0, "stream": True}
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # one event, then hang up
        wait_for(lambda: jobs[0].done)
        assert jobs[0].cancelled and jobs[0].rounds_after_cancel <= 1
        assert jobs[0].rounds < 300  # it did not run to its 480 tokens
        scheduler = app.state.scheduler
        wait_for(lambda: scheduler.queued == scheduler.running == 0)

        # A non-streaming request whose client hangs up is cancelled too.
        raw = json.dumps({**body, "stream": False}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
            wait_for(lambda: len(jobs) == 2 and jobs[1].rounds > 0)
        wait_for(lambda: jobs[1].done)
        assert jobs[1].cancelled and jobs[1].rounds_after_cancel <= 1

        # The next request gets the slot and its full answer.
        reply = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 12})
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["text"] == solo(pair, "Hello", 12, chat=False).text
        metrics = http.get("/metrics").text
        assert 'specedge_generations_total{reason="cancelled"} 2' in metrics


class SlowPair(Pair):
    """A pair whose generations wait on `gate` before decoding and sleep `delay` per round
    (its servers skip the warm-up, which would wait too)."""

    def __init__(self, pair: Pair, delay: float = 0.0) -> None:
        super().__init__(pair.manifest, pair.tokenizer, pair.target, pair.draft)
        self.entered, self.gate, self.delay = threading.Event(), threading.Event(), delay

    def open(self, prompt: Any, config: GenerationConfig | None = None,
             stats: Any = None) -> Any:
        self.entered.set()
        assert self.gate.wait(30)
        ids, output, inner = super().open(prompt, config, stats)

        def slow() -> Any:
            try:
                while True:
                    try:
                        kept = next(inner)
                    except StopIteration as done:
                        return done.value
                    time.sleep(self.delay)
                    yield kept
            finally:
                inner.close()

        return ids, output, slow()


def test_full_queue_answers_429_with_retry_after(pairs: dict[str, Pair]) -> None:
    pair = SlowPair(pairs["gqa"])
    app = create_app(pair, ServerOptions(max_queue=1, max_tokens_limit=64, warmup_tokens=0))
    body = {"model": pair.manifest.root.name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8, "temperature": 0}
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(
            http.post("/v1/chat/completions", json=body))) for _ in range(2)]
        threads[0].start()
        assert pair.entered.wait(10)  # the first one holds the worker
        threads[1].start()
        wait_for(lambda: app.state.scheduler.queued >= 2)  # one running (blocked), one waiting
        refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        pair.gate.set()
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        want = solo(pairs["gqa"], "Hi", 8).text
        assert all(r.json()["choices"][0]["message"]["content"] == want for r in results)
        assert "specedge_rejected_total 1" in http.get("/metrics").text
        assert http.get("/health").json()["status"] == "ok"


def test_deadline_ends_a_request(pairs: dict[str, Pair]) -> None:
    pair = SlowPair(pairs["gqa"], delay=0.05)
    pair.gate.set()
    app = create_app(pair, ServerOptions(request_timeout_s=0.3, max_tokens_limit=200,
                                         warmup_tokens=0))
    body = {"model": pair.manifest.root.name, "prompt": "Hello", "max_tokens": 200,
            "temperature": 0}
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        late = http.post("/v1/completions", json=body)
        assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIError, match="limit of 0.3 s"):
            for _ in client.completions.create(model=body["model"], prompt="Hello",
                                               max_tokens=200, temperature=0, stream=True):
                pass
        assert http.get("/health").status_code == 200


def test_a_stalled_body_gets_408_and_frees_the_connection(pairs: dict[str, Pair]) -> None:
    """A client that sends its headers and part of its body, then stalls, must not hold the
    connection (and a handler) forever: it gets 408 in OpenAI's format and the server closes
    the socket; the server keeps answering others meanwhile."""
    app = create_app(pairs["gqa"], ServerOptions(receive_timeout_s=0.5))
    body = json.dumps({"model": pairs["gqa"].manifest.root.name, "prompt": "Hi"}).encode()
    with running(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
            started = time.monotonic()
            with httpx.Client(base_url=url, timeout=10) as http:
                assert http.get("/health").status_code == 200
            reply = b""
            while chunk := sock.recv(65536):  # the server closes the connection after 408
                reply += chunk
            waited = time.monotonic() - started
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply[:200]
        error = json.loads(payload)["error"]
        assert error["code"] == "request_timeout" and "--receive-timeout" in error["message"]
        assert 0.3 < waited < 5, waited


def test_a_connection_without_a_request_head_is_closed(pairs: dict[str, Pair]) -> None:
    """uvicorn alone keeps a connection that sends nothing, or trickles a request head, open for
    good (its keep-alive timer restarts with every byte and does not run before a first
    request). With `request_deadline_protocol` each head must be complete in time: from the
    connection, and again after each response. Requests in progress are never cut."""
    from specedge.runtime.http_deadline import request_deadline_protocol

    pair = SlowPair(pairs["gqa"], delay=0.3)
    pair.gate.set()
    app = create_app(pair, ServerOptions(receive_timeout_s=5, warmup_tokens=0))
    with running(app, http=request_deadline_protocol(0.8)) as url:
        port = int(url.rsplit(":", 1)[1])

        def closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
            """Seconds until the server closes `sock`, sending `trickle` a byte at a time."""
            started = time.monotonic()
            sock.settimeout(0.1)
            for byte in trickle:
                try:
                    if sock.recv(65536) == b"":
                        return time.monotonic() - started
                except TimeoutError:
                    pass
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # already closed by the server
                    return time.monotonic() - started
            sock.settimeout(10)
            while sock.recv(65536):
                pass
            return time.monotonic() - started

        with socket.create_connection(("127.0.0.1", port)) as silent:
            assert 0.5 < closed_after(silent) < 5
        with socket.create_connection(("127.0.0.1", port)) as trickling:
            head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
            assert 0.5 < closed_after(trickling, head) < 5
        # A keep-alive connection: the deadline runs again after each response, and a
        # response that takes longer than the deadline is not cut.
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(3):
                assert http.get("/health").status_code == 200
                time.sleep(0.3)
            started = time.monotonic()
            slow = http.post("/v1/completions", json={
                "model": pair.manifest.root.name, "prompt": "Hello", "max_tokens": 16,
                "temperature": 0, "stream": True})
            assert slow.status_code == 200 and slow.text.rstrip().endswith("data: [DONE]")
            assert time.monotonic() - started > 1.0  # longer than the deadline, not cut


# ------------------------------------------------------------------------------- bad input


def _bad_cases(model: str) -> list[tuple[str, Any, int, str | None]]:
    msg = [{"role": "user", "content": "Hi"}]
    chat = {"model": model, "messages": msg}
    long_prompt = "word " * 2000  # more tokens than the tiny pairs' 512-token context
    return [
        ("malformed json", b"{not json", 400, None),
        ("not an object", b"[1, 2]", 400, None),
        ("deeply nested json", b"[" * 30000 + b"]" * 30000, 400, None),
        ("messages wrong type", {**chat, "messages": "Hi"}, 400, "messages"),
        ("max_tokens wrong type", {**chat, "max_tokens": "12"}, 400, "max_tokens"),
        ("temperature wrong type", {**chat, "temperature": "hot"}, 400, "temperature"),
        ("stream wrong type", {**chat, "stream": "yes"}, 400, "stream"),
        ("stop wrong type", {**chat, "stop": 5}, 400, "stop"),
        ("presence_penalty above 2", {**chat, "presence_penalty": 2.5}, 400,
         "presence_penalty"),
        ("frequency_penalty wrong type", {**chat, "frequency_penalty": "x"}, 400,
         "frequency_penalty"),
        ("repetition_penalty 0", {**chat, "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("logit_bias key not a token id", {**chat, "logit_bias": {"hi": 1}}, 400, "logit_bias"),
        ("logit_bias above 100", {**chat, "logit_bias": {"3": 101}}, 400, "logit_bias"),
        ("logit_bias outside the vocabulary", {**chat, "logit_bias": {"100000000": 1}}, 400,
         "logit_bias"),
        ("n=17", {**chat, "n": 17}, 400, "n"),
        ("n=0", {**chat, "n": 0}, 400, "n"),
        ("top_logprobs without logprobs", {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        ("top_logprobs above 20", {**chat, "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs"),
        ("completions logprobs above 5", {"model": model, "prompt": "Hi", "logprobs": 6}, 400,
         "logprobs"),
        ("echo on chat", {**chat, "echo": True}, 400, "echo"),
        ("an empty prompt among several", {"model": model, "prompt": ["Hi", ""]}, 400,
         "prompt"),
        ("an empty token-id prompt", {"model": model, "prompt": [[1, 2], []]}, 400, "prompt"),
        ("mixed prompt", {"model": model, "prompt": [1, "a"]}, 400, "prompt"),
        ("token id outside the vocabulary", {"model": model, "prompt": [10**7]}, 400, "prompt"),
        ("a tool without a valid name", {**chat, "tools": [
            {"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name"),
        ("response_format xml", {**chat, "response_format": {"type": "xml"}}, 400,
         "response_format"),
        ("json_schema without a schema", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
        ("a schema that does not compile", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}},
         400, "response_format"),
        ("a regex that does not compile", {**chat, "structured_outputs": {"regex": "[a-"}},
         400, "structured_outputs"),
        ("two structured_outputs keys", {**chat, "structured_outputs": {
            "regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
        ("response_format and guided_regex", {**chat, "response_format": {
            "type": "json_object"}, "guided_regex": "a+"}, 400, "guided_regex"),
        ("guided_choice empty", {**chat, "guided_choice": []}, 400, "guided_choice"),
        ("min_tokens negative", {**chat, "min_tokens": -1}, 400, "min_tokens"),
        ("ignore_eos wrong type", {**chat, "ignore_eos": "yes"}, 400, "ignore_eos"),
        ("stop_token_ids wrong type", {**chat, "stop_token_ids": [1, "2"]}, 400,
         "stop_token_ids"),
        ("stop_token_ids outside the vocabulary", {**chat, "stop_token_ids": [10**8]}, 400,
         "stop_token_ids"),
        ("negative max_tokens", {**chat, "max_tokens": -1}, 400, "max_tokens"),
        ("huge max_tokens", {**chat, "max_tokens": 10**12}, 400, "max_tokens"),
        ("zero max_completion_tokens", {**chat, "max_completion_tokens": 0}, 400,
         "max_completion_tokens"),
        ("empty messages", {**chat, "messages": []}, 400, "messages"),
        ("unknown role", {**chat, "messages": [{"role": "function", "content": "x"}]}, 400,
         "messages[0].role"),
        ("image part", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
        ("unknown model", {**chat, "model": "gpt-4o"}, 404, "model"),
        ("missing model", {"messages": msg}, 400, "model"),
        ("unknown drafter", {**chat, "drafter": "oracle"}, 400, "drafter"),
        ("prompt longer than the context", {**chat, "messages": [
            {"role": "user", "content": long_prompt}]}, 400, "messages"),
        ("context overflow with max_tokens", {"model": model, "prompt": "word " * 100,
                                              "max_tokens": 480}, 400, "prompt"),
        ("oversize body", {**chat, "messages": [
            {"role": "user", "content": "x" * (BODY_LIMIT + 10)}]}, 413, None),
    ]


def test_bad_input_is_4xx_in_openai_format(served: Served) -> None:
    folder = str(served.pair.manifest.root)
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for name, body, status, param in _bad_cases(served.model):
            path = "/v1/completions" if isinstance(body, dict) and "prompt" in body \
                else "/v1/chat/completions"
            if isinstance(body, bytes):
                reply = http.post(path, content=body,
                                  headers={"Content-Type": "application/json"})
            else:
                reply = http.post(path, json=body)
            assert reply.status_code == status, (name, reply.text)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["message"] and error["param"] == param, (name, error)
            assert "Traceback" not in reply.text and folder not in reply.text, name
        assert http.get("/nowhere").status_code == 404
        missing = http.get("/nowhere").json()["error"]
        assert missing["code"] == "not_found"
        assert "no route /nowhere" in missing["message"]
        assert "POST /v1/chat/completions" in missing["message"]
        slash = http.post("/v1/chat/completions/", json={"model": served.model})
        assert slash.status_code == 404 and slash.json()["error"]["message"].startswith(
            "There is no route /v1/chat/completions/ (did you mean /v1/chat/completions?)")
        wrong = http.post("/v1/models")
        assert wrong.status_code == 405 and wrong.json()["error"]["message"] == (
            "POST is not allowed on /v1/models; use GET, HEAD.")
        assert http.get("/health").json()["status"] == "ok"
    reply = served.client().chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_the_batch_shares_one_drafter(pairs: dict[str, Pair]) -> None:
    pair = pairs["concat"]
    app = create_app(pair, ServerOptions(num_draft_tokens=2))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"model": pair.manifest.root.name, "prompt": "Hi", "max_tokens": 4}
        assert http.post("/v1/completions", json={**body, "num_draft_tokens": 2}).is_success
        refused = http.post("/v1/completions", json={**body, "num_draft_tokens": 5})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "num_draft_tokens"


# ------------------------------------------------------------------------------- API key


def test_api_key(pairs: dict[str, Pair], monkeypatch: pytest.MonkeyPatch,
                 caplog: pytest.LogCaptureFixture) -> None:
    key, compared = "sk-test-0123456789", []
    real = server_http_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(len(a) == len(b) == 32)
        return real(a, b)

    monkeypatch.setattr(server_http_module.hmac, "compare_digest", spy)
    pair = pairs["gqa"]
    app = create_app(pair, ServerOptions(api_key=key))
    assert key not in repr(ServerOptions(api_key=key))
    model = pair.manifest.root.name
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}):
            for path in ("/v1/models", "/metrics"):
                reply = http.get(path, headers=headers)
                assert reply.status_code == 401, (path, headers)
                assert reply.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).is_success
        assert compared and all(compared)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        reply = client.completions.create(model=model, prompt="Hi", max_tokens=4,
                                          temperature=0)
        assert reply.choices[0].text == solo(pair, "Hi", 4, chat=False).text
    assert key not in caplog.text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_cli_serves_and_never_logs_the_key(tiny_pair_dir: Path) -> None:
    key, port = "sk-cli-secret-42", _free_port()
    env = {**os.environ, "SPECEDGE_API_KEY": key}
    # through the `specedge` group, as users run it (its root handler hid serve's info lines)
    proc = subprocess.Popen([sys.executable, "-m", "specedge.cli", "serve", str(tiny_pair_dir),
                             "--port", str(port), "--log-level", "debug"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).is_success:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope-guess"}
                         ).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model=tiny_pair_dir.name, messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6, temperature=0)
        assert reply.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "Application startup complete" in out and "API key required" in out
    assert "INFO:     warm-up: 8 tokens in" in out
    assert key not in out and "nope-guess" not in out


# ------------------------------------------------------------------------------- models, metrics


def test_models_health_and_metrics(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list()] == [served.model]
    assert client.models.retrieve(served.model).id == served.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    before = _metric(served, "specedge_completion_tokens_total")
    reply = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=10, temperature=0)
    assert reply.usage is not None
    with httpx.Client(base_url=served.url) as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["model"] == served.model
        text = http.get("/metrics").text
    assert _metric(served, "specedge_completion_tokens_total") - before == \
        reply.usage.completion_tokens
    for name in ("specedge_requests_total", "specedge_acceptance_rate",
                 "specedge_tokens_per_round", "specedge_queue_depth",
                 "specedge_time_to_first_token_seconds_bucket",
                 "specedge_time_per_output_token_seconds_bucket",
                 'specedge_requests_total{route="/v1/chat/completions",status="200"}'):
        assert name in text, name
    assert 'le="+Inf"' in text and "# TYPE specedge_time_to_first_token_seconds histogram" in text


def _metric(served: Served, name: str) -> float:
    text = httpx.get(served.url + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


# ------------------------------------------------------------------------------- request parsing


def test_parse_request_fields() -> None:
    defaults = RequestDefaults(model="m", max_tokens_limit=100)
    parsed = parse_request("chat", {
        "model": "m", "messages": [{"role": "developer", "content": [
            {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 7, "max_tokens": 9, "stop": "\n", "seed": -1, "top_k": 5,
        "min_p": 0.1, "user": "ignored", "store": False, "stream": True,
        "stream_options": {"include_usage": True}}, defaults)
    assert parsed.prompt == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]
    config = parsed.config
    assert (config.max_new_tokens, config.stop, config.sampling.seed) == (7, ("\n",), 2**64 - 1)
    assert (config.sampling.temperature, config.sampling.top_k, config.sampling.min_p) == (
        1.0, 5, 0.1)
    assert parsed.stream and parsed.include_usage and parsed.max_tokens_given
    unset = parse_request("text", {"model": "m", "prompt": ["Hi"]}, defaults)
    assert unset.config.max_new_tokens == 100 and not unset.max_tokens_given
    assert [finish_reason(r) for r in ("eos", "stop", "max_new_tokens", "context")] == [
        "stop", "stop", "length", "length"]


def _doc_block(marker: str) -> str:
    text = (ROOT / "docs" / "serve.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b)
    return str(block)


def test_doc_client_example_runs(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    code = _doc_block("from openai import OpenAI").replace(
        "http://127.0.0.1:8000", served.url).replace('"smollm2-135m"', repr(served.model))
    exec(compile(code, "docs/serve.md", "exec"), {})
    want = solo(served.pair, "What is the capital of France?", 32).text
    assert capsys.readouterr().out.startswith(want + " {'acceptance_rate'")


def test_doc_structured_example_runs(served: Served) -> None:
    code = _doc_block("structured_outputs").replace('"smollm2-135m-fast"', repr(served.model))
    scope: dict[str, Any] = {"client": served.client()}
    exec(compile(code, "docs/serve.md", "exec"), scope)
    reply, code_reply = scope["reply"], scope["code"]
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content)["city"], str)
    assert content.startswith('{"city": "')
    assert re.fullmatch("[0-9]{5}", code_reply.choices[0].text)


def test_doc_embedding_example_mounts(tiny_pair_dir: Path) -> None:
    code = _doc_block("create_app").replace('"pairs/smollm2-135m"', repr(str(tiny_pair_dir)))
    code, runs = re.subn(r"uvicorn\.run\(app, host=\"127\.0\.0\.1\", port=8000, "
                         r"http=request_deadline_protocol\(30\)\)", "", code)
    assert runs == 1
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/serve.md", "exec"), scope)
    with running(scope["app"], http=scope["request_deadline_protocol"](30)) as url:
        assert httpx.get(url + "/llm/health").json()["status"] == "ok"
        client = openai.OpenAI(base_url=url + "/llm/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model=tiny_pair_dir.name, prompt="Hi", max_tokens=4,
                                          temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert scope["llm"].state.scheduler.warmup_s > 0  # the example warmed the mounted app
    scope["llm"].state.scheduler.close()


def test_server_imports_without_torch(tiny_pair_dir: Path) -> None:
    from .test_no_torch import BLOCKER

    code = BLOCKER + f"""
from specedge.runtime.pair import Pair
from specedge.runtime.server import create_app
create_app(Pair.load({str(tiny_pair_dir)!r}))
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_a_broken_chat_template_stops_the_server_at_start(pair_copy: Path) -> None:
    """Every chat request would fail with a 400 the operator never sees: create_app (and so
    `specedge serve`, before it listens) refuses the pair instead."""
    (pair_copy / "chat_template.jinja").write_text("{{ raise_exception('broken') }}")
    rehash(pair_copy, "chat_template.jinja")
    with pytest.raises(InputError, match="chat template fails for a user turn .*broken"):
        create_app(Pair.load(pair_copy))


@pytest.mark.parametrize("form", list(FORMS))
def test_the_server_warms_up_before_it_listens(pairs: dict[str, Pair], form: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A few tokens decoded at startup, before uvicorn listens, through the engine requests use
    (on the CPU the concat pair's first request took 0.86 s cold and 0.45 s warm, the next ones
    0.64 / 0.47 s against 0.41 / 0.40 s: the tuner learned its costs); output unchanged.
    `warmup_tokens=0` turns it off; a prompt that does not fit the context skips it."""
    pair = pairs[form]

    def warmup_gauge(url: str) -> float:
        text = httpx.get(url + "/metrics").text
        return float(next(ln for ln in text.splitlines()
                          if ln.startswith("specedge_warmup_seconds ")).split()[1])

    caplog.set_level(logging.INFO, logger="specedge.serve")
    app = create_app(pair, ServerOptions(warmup_tokens=4))
    with running(app) as url:
        assert warmup_gauge(url) > 0 and "warm-up: 4 tokens in" in caplog.text
        served = Served(pair, url, app)
        reply = served.client().chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == solo(pair, [
            {"role": "user", "content": "Hello there"}], 12).text
    with running(create_app(pair, ServerOptions(warmup_tokens=0))) as url:
        assert warmup_gauge(url) == 0
    caplog.clear()
    with running(create_app(pair, ServerOptions(max_context=4))) as url:
        assert warmup_gauge(url) == 0 and "warm-up skipped" in caplog.text
        assert httpx.get(url + "/health").json()["status"] == "ok"


def test_server_options_are_checked() -> None:
    for bad in ({"max_batch": 0}, {"max_body_bytes": 10}, {"api_key": " "}, {"warmup_tokens": -1},
                {"request_timeout_s": 0}, {"receive_timeout_s": 0},
                {"receive_timeout_s": float("nan")}, {"receive_timeout_s": "5"},
                {"prefill_budget": -1}, {"prefill_budget": True}):
        with pytest.raises(InputError):
            ServerOptions(**bad)
