"""Reliability: NaN models, concurrency, soak (short), fuzzing of templates and sampling, Ctrl-C."""

from __future__ import annotations

import json
import os
import resource
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specedge.runtime.acceptance import accept_greedy, accept_sample
from specedge.runtime.errors import InputError, ModelError, SpecEdgeError
from specedge.runtime.files import sha256_file
from specedge.runtime.manifest import MANIFEST_NAME
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams, warp_probs
from specedge.runtime.text import Tokenizer


def _poison(pair_dir: Path, tmp_path: Path, model: str) -> Path:
    """A copy of the pair whose `model` weights are all NaN (hashes updated)."""
    import importlib.util

    if importlib.util.find_spec("onnx") is None:
        pytest.skip("needs onnx to edit the model")
    import onnx
    from onnx import numpy_helper

    out = tmp_path / "poisoned"
    shutil.copytree(pair_dir, out)
    path = out / model / "model.onnx"
    proto = onnx.load(str(path))
    for init in proto.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype == np.float32 and arr.ndim == 1:  # norm weights: NaN everywhere after
            init.CopyFrom(numpy_helper.from_array(np.full_like(arr, np.nan), init.name))
    onnx.save(proto, str(path), save_as_external_data=True, location="model.onnx.data")
    doc = json.loads((out / MANIFEST_NAME).read_text())
    spec = doc["models"][model]
    spec["files"] = {rel: sha256_file(out / rel) for rel in spec["files"]}
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    return out


@pytest.mark.export  # editing the ONNX file needs the onnx package
@pytest.mark.parametrize("model", ["target", "draft"])
def test_nan_logits_stop_with_an_error_naming_the_model(tiny_pair_dir: Path, tmp_path: Path,
                                                        model: str) -> None:
    pair = Pair.load(_poison(tiny_pair_dir, tmp_path, model))
    with pytest.raises(ModelError, match=f"the {model} model .* NaN or inf"):
        pair.generate("The quick", GenerationConfig(max_new_tokens=8, drafter="model"))


def test_concurrent_generations_match_single_thread(tiny_pair: Pair) -> None:
    """Threads share the sessions, not the caches: outputs equal single-thread runs."""
    prompts = ["The quick brown", "def add(a, b):", "héllo 🙂", "Edge devices like"] * 2
    configs = [GenerationConfig(max_new_tokens=30, num_draft_tokens=k, adaptive=False,
                                sampling=SamplingParams(temperature=t, seed=i))
               for i, (k, t) in enumerate([(1, 0.0), (3, 0.9), (2, 0.0), (4, 1.1)] * 2)]
    expected = [tiny_pair.generate(p, c).tokens for p, c in zip(prompts, configs, strict=True)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = tiny_pair.generate(prompts[i], configs[i]).tokens
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == expected


def test_soak_short(tiny_pair: Pair) -> None:
    """Hundreds of generations through one loaded pair: RSS and time per token stay flat."""
    cfg = GenerationConfig(max_new_tokens=24, num_draft_tokens=3,
                           sampling=SamplingParams(temperature=0.8, top_p=0.95))

    def batch(n: int) -> float:
        tokens = seconds = 0.0
        for i in range(n):
            r = tiny_pair.generate(f"The quick brown {i}", cfg)
            tokens += r.stats.new_tokens
            seconds += r.stats.total_s
        return seconds / tokens

    batch(50)  # warm-up: allocator pools, caches of shapes
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    first = batch(150)
    mid_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    last = batch(150)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (rss1 - mid_rss) / 1024 < 16, f"peak RSS grew {(rss1 - mid_rss) / 1024:.1f} MiB"
    assert (rss1 - rss0) / 1024 < 32
    assert last < first * 2.0, (first, last)


FUZZ = int(os.environ.get("SPECEDGE_FUZZ_EXAMPLES", "150"))  # raise for a long fuzz run


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=2,
                       max_size=40),
       temperature=st.floats(0.0, 5.0), top_k=st.integers(0, 50),
       top_p=st.floats(0.01, 1.0), min_p=st.floats(0.0, 0.99), k=st.integers(0, 6),
       seed=st.integers(0, 2**31))
def test_fuzz_sampling(logits: list[float], temperature: float, top_k: int, top_p: float,
                       min_p: float, k: int, seed: int) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = np.asarray([logits] * (k + 1), dtype=np.float32)
    probs = warp_probs(rows, params)
    assert np.isfinite(probs).all() and np.allclose(probs.sum(-1), 1.0)
    rng = np.random.default_rng(seed)
    drafts = rng.integers(0, len(logits), k)
    out = accept_greedy(drafts, rows)
    assert 1 <= len(out) <= k + 1
    draft_probs = warp_probs(rows[:k], SamplingParams(temperature=1.0)) if k else \
        np.zeros((0, len(logits)))
    out = accept_sample(drafts, draft_probs, probs, rng)
    assert 1 <= len(out) <= k + 1 and list(out[:-1]) == list(drafts[: len(out) - 1])
    assert all(probs[i, t] > 0 for i, t in enumerate(out[-1:], start=len(out) - 1))


_TEMPLATES = st.sampled_from([
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "{{ messages[0]['content'] | upper }}{% if add_generation_prompt %}>{% endif %}",
    "{{ raise_exception('nope') }}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{{ undefined_thing.attr }}",
    "{{ ''.__class__.__mro__ }}",
    "{% for x in range(10**9) %}{% endfor %}",
    "{{ messages | tojson }}",
    "{% if %}",
    # hostile: hang, or build text the tokenizer cannot hold (issue 18, item 2)
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(26) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{{ 'a' * 1000000000 }}",
    "{{ '{:>1000000000}'.format(messages | length) }}",
    "{% for m in messages %}{{ m.content | center(1000000000) }}{% endfor %}",
])


@settings(max_examples=max(80, FUZZ // 2), deadline=None)
@given(template=_TEMPLATES,
       messages=st.lists(st.fixed_dictionaries({
           "role": st.sampled_from(["user", "assistant", "system", "", "x" * 50]),
           "content": st.text(max_size=40)}), max_size=4))
def test_fuzz_chat_template(template: str, messages: list[dict[str, str]],
                            tmp_path_factory: pytest.TempPathFactory) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    folder = tmp_path_factory.mktemp("tpl")
    HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_folder(folder)
    start = time.perf_counter()
    try:
        out = tok.render_chat(messages)
        assert isinstance(out, str)
    except InputError:
        pass  # a clear, typed error is the contract
    assert time.perf_counter() - start < 5  # renders are bounded to ~1 s


def test_errors_are_one_line(tiny_pair: Pair) -> None:
    cases = [
        lambda: tiny_pair.generate(""),
        lambda: tiny_pair.generate_ids([-1]),
        lambda: GenerationConfig(max_new_tokens=0),
        lambda: SamplingParams(temperature=float("nan")),
        lambda: SamplingParams(top_p=0.0),
        lambda: GenerationConfig(num_draft_tokens=65),
        lambda: tiny_pair.generate("word " * 5000),
    ]
    for case in cases:
        with pytest.raises(SpecEdgeError) as info:
            case()
        assert "\n" not in str(info.value) and str(info.value)
