"""Calibration data: read it, tokenize it, and turn it into the inputs the model really sees.

Readers: a text file (paragraphs separated by blank lines), a JSONL file of prompts
(`{"prompt": ...}`), chats (`{"messages": [...]}`) or texts (`{"text": ...}`), and a small
built-in offline sample. A model in a speculative pair sees two kinds of inputs: a prefill of a
prompt, and decode/verify steps of 1..K+1 tokens after a real past. `model_feeds` produces both,
at the pair's own precision: the past keys/values come from running the model itself on the
text, so calibration ranges cover what `generate` will feed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specedge.runtime.backend import OrtModel
from specedge.runtime.chat_template import validate_messages
from specedge.runtime.errors import InputError
from specedge.runtime.pair import Pair
from specedge.runtime.prompts import read_text_file
from specedge.runtime.sessions import SessionConfig

BUILTIN_TEXTS = (
    "The river runs through the old town, under seven stone bridges built over four centuries. "
    "In spring the water rises with melted snow, and the market moves up to the square.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let it "
    "rise for an hour, shape it, and bake it in a hot oven until the crust is brown.",
    "def mean(values):\n    if not values:\n        raise ValueError('empty')\n    return "
    "sum(values) / len(values)\n\nprint(mean([1, 2, 3]))",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, which contain the green pigment chlorophyll.",
    "Dear team, thank you for your work this quarter. We shipped the new release on time, "
    "customer satisfaction went up, and we start planning the next version on Monday.",
    "Question: why do we have leap years? Answer: a year is about 365.25 days long, so an "
    "extra day every four years keeps the calendar in step with the seasons.",
    "The committee reviewed three proposals for the new park. The first keeps the old trees, "
    "the second adds a playground, and the third builds a small lake with a walking path.",
    "Speculative decoding lets a small draft model propose several tokens that a larger model "
    "checks in one pass; the output is the same, but generation is faster.",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = "
    "orders.customer_id GROUP BY name ORDER BY orders DESC LIMIT 10;",
    "Mountains form when tectonic plates collide and push the crust upward over millions of "
    "years. Erosion by wind, water and ice slowly wears them down again.",
    "User: Can you suggest a name for my bakery? Assistant: How about 'Rise and Shine', "
    "'The Golden Crust', or 'Flour Power'?",
    "The train leaves at 8:15 from platform 4 and arrives at 10:40. Tickets can be bought at "
    "the station or online, and children under six travel for free.",
)


CALIBRATION_PROMPTS = (
    "Tell me about the history of the bicycle.",
    "How do I make a good cup of coffee at home?",
    "Write a poem about autumn leaves.",
    "What are the benefits of regular exercise?",
    "Explain how the internet works.",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "Describe a day in the life of a lighthouse keeper.",
    "What is the difference between a virus and a bacterium?",
    "Give me tips for learning a new language.",
    "Summarize the following text in one sentence.\n\nThe museum reopened after a year of "
    "repairs with a new wing for modern art, longer opening hours and free entry on Sundays.",
    "How does a refrigerator keep food cold?",
    "Write a short dialogue between two friends planning a trip.",
    "Explain recursion with a simple example in JavaScript.",
    "What should I pack for a weekend hiking trip?",
    "Why do cats purr?",
    "Write a thank-you note to a colleague who helped with a project.",
)

HELDOUT_TEXTS = (
    "The lighthouse stood on a rock at the mouth of the bay. Every night its beam swept across "
    "the water, and the fishing boats used it to find their way home through the fog.",
    "A good password is long and hard to guess. Use a password manager, turn on two-factor "
    "authentication, and never reuse the same password on different websites.",
    "for item in inventory:\n    if item.quantity < item.reorder_level:\n        "
    "order(item.name, item.reorder_amount)\n",
    "The museum's new exhibition shows how people in the Bronze Age made tools, traded metals "
    "across long distances, and buried their leaders with bronze weapons and gold jewelry.",
    "Our meeting is moved to Thursday at three o'clock. Please read the attached report before "
    "then and send me your questions about the budget by Wednesday evening.",
    "Owls hunt at night using their excellent hearing. Their feathers are shaped to make almost "
    "no sound, so mice and voles rarely hear them coming.",
)


@dataclass(frozen=True)
class CalibrationOptions:
    """How much calibration data, from which seed, in which shapes."""

    samples: int = 16
    seed: int = 0
    max_prefill: int = 96
    step_sizes: tuple[int, ...] = (1, 3, 5)  # decode/verify steps after a real past

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise InputError(f"--samples must be >= 1, got {self.samples}")
        if not 0 <= self.seed < 2**63:
            raise InputError(f"--seed must be an integer in [0, 2**63), got {self.seed}")
        if self.max_prefill < 2:
            raise InputError(f"--max-prefill must be >= 2, got {self.max_prefill}")
        if any(s < 1 for s in self.step_sizes):
            raise InputError("step sizes must be >= 1")


Chat = list[dict[str, Any]]
CalibrationText = str | Chat  # plain text, or chat messages rendered by the chat template


def read_texts(path: Path | None) -> list[CalibrationText]:
    """Texts from a .txt (blank-line separated, always plain text) or .jsonl file (`text` or
    `prompt`: plain text; `messages`: a chat, checked here); the built-in sample for None.

    Raises:
        InputError: missing/empty/undecodable file, a JSONL line without prompt/text/messages,
            or with malformed messages (`PATH:LINE: ...`).
    """
    if path is None:
        return list(BUILTIN_TEXTS)
    raw = read_text_file(path, "calibration data", "calibration file")
    texts: list[CalibrationText] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                raise InputError(f"{path}:{n}: not valid JSON") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{n}: expected a JSON object")
            if isinstance(obj.get("text"), str):
                texts.append(obj["text"])
            elif isinstance(obj.get("prompt"), str):
                texts.append(obj["prompt"])
            elif "messages" in obj:
                try:
                    texts.append(validate_messages(obj["messages"]))
                except InputError as exc:
                    raise InputError(f"{path}:{n}: {exc}") from None
            else:
                raise InputError(f"{path}:{n}: expected a \"text\", \"prompt\" or "
                                 "\"messages\" key")
    else:
        texts = [t.strip() for t in raw.split("\n\n") if t.strip()]
    if not texts:
        raise InputError(f"{path}: no calibration text in the file")
    return texts


def tokenize(pair: Pair, texts: Sequence[CalibrationText], opts: CalibrationOptions
             ) -> list[list[int]]:
    """Token ids per text (chats through the template); too-long texts are an error."""
    limit = pair.manifest.target.max_seq_len
    out: list[list[int]] = []
    for i, text in enumerate(texts):
        ids = (pair.tokenizer.encode(text) if isinstance(text, str)
               else pair.tokenizer.encode_chat(text))
        if len(ids) < 2:
            raise InputError(f"calibration text {i + 1} has fewer than 2 tokens")
        if len(ids) > limit:
            raise InputError(f"calibration text {i + 1} has {len(ids)} tokens, more than the "
                             f"context of {limit}; shorten or split it")
        out.append(ids)
    rng = np.random.default_rng(opts.seed)
    order = rng.permutation(len(out))
    return [out[i] for i in order[: opts.samples]]


def model_feeds(root: Path, model: OrtModel, token_lists: Sequence[Sequence[int]],
                opts: CalibrationOptions) -> Iterator[dict[str, np.ndarray]]:
    """ONNX Runtime feeds for a plain `session.run`: prefills and steps with a real past.

    For every text: one prefill of up to `max_prefill` tokens, then for each step size s a
    step of s tokens after the real past (keys/values computed by `model` itself).
    """
    spec = model.spec
    reader = OrtModel(root, spec, model.name, SessionConfig())
    for ids in token_lists:
        prefix = list(ids[: opts.max_prefill])
        yield _feed(spec, np.asarray([prefix], np.int64), None)
        for s in opts.step_sizes:
            if len(prefix) <= s:
                continue
            past_len = len(prefix) - s
            cache = reader.new_cache(1, len(prefix) + 1)
            reader.forward(cache, np.asarray([prefix[:past_len]], np.int64))
            past = [np.ascontiguousarray(v.numpy()[:, :, :past_len]) for v in cache.values]
            yield _feed(spec, np.asarray([prefix[past_len:]], np.int64), past)


def _feed(spec: Any, tokens: np.ndarray, past: list[np.ndarray] | None) -> dict[str, np.ndarray]:
    batch, new = tokens.shape
    past_len = 0 if past is None else past[0].shape[2]
    feed: dict[str, np.ndarray] = {
        spec.input_ids: tokens,
        spec.attention_mask: np.ones((batch, past_len + new), np.int64),
    }
    if spec.position_ids:
        feed[spec.position_ids] = np.arange(past_len, past_len + new, dtype=np.int64)[None]
    dtype = np.float16 if spec.kv.dtype == "float16" else np.float32
    names = [spec.kv.past_key.format(i=i) for i in range(spec.num_layers)] + [
        spec.kv.past_value.format(i=i) for i in range(spec.num_layers)]
    for n, name in enumerate(names):
        feed[name] = past[n] if past is not None else np.zeros(
            (batch, spec.num_kv_heads, 0, spec.head_dim), dtype)
    return feed
