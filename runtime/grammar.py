"""Structured output: a grammar decides which tokens each output position may take.

`Grammar` names what the output must match: a JSON schema, any JSON object, a regular
expression, a Lark or llama.cpp GBNF grammar, or one of a list of strings. llguidance (the
library behind ONNX Runtime GenAI's and vLLM's guided decoding) compiles it against the pair's
tokenizer and computes, for a sequence of tokens, the mask of tokens that may follow.

`GrammarState` is one row's place in its grammar. It follows whatever token sequence it is
asked about (rolling back and consuming, never entering llguidance's error state), so one row
can mask its draft steps (the output plus the drafts so far) and then its verification block:
row i of a block is masked for the output plus the first i drafts, which is exactly the mask
target-only decoding applies at that position. Disallowed logits become -inf before sampling,
so greedy and sampled speculative output stays the target's constrained output. A draft that
breaks the grammar is rejected by verification (its masked probability is 0).

Where the grammar forces text, llguidance allows only that text's own tokenization; when the
text is one of the tokenizer's added tokens (a grammar that spells `<think>` for Qwen3),
llguidance allows that token and then refuses it (it matches added tokens only as themselves,
llguidance issue 366 and outlines issue 1771). A mask keeps only the tokens the matcher takes,
so such a grammar ends its output there (eos, with a warning naming the token) instead of
sampling from nothing until `max_tokens`.

A grammar `after` a reasoning model's thinking (`runtime/reasoning.Thinking`) holds for the
answer only: the compiler puts the thinking's Lark rules before it, as a grammar of its own that
references this one (llguidance's nested grammars), so the matcher follows the whole reply.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import InputError
from .reasoning import Thinking

__all__ = ["GRAMMAR_KINDS", "Grammar", "GrammarCompiler", "GrammarState"]

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_GRAMMAR_CHARS = 200_000
_ANY_OBJECT = '{"type": "object"}'
# JSON as `json.dumps` writes it (and models most often do): no free whitespace, so a model
# cannot pad the output, and drafts agree more often. A schema's "x-guidance" overrides it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANSWER = "specedge_answer"  # the name the grammar after a thinking lead is referenced by
_CHECKED = 8  # masks of at most this many tokens (a forced path) are checked token by token
log = logging.getLogger(__name__)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of specedge
        raise InputError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the output must match.

    Attributes:
        kind: "json_schema" (`source`: the schema as JSON text), "json_object" (any JSON
            object; no source), "regex" (a Rust-syntax regular expression), "grammar" (a Lark
            grammar, or a llama.cpp GBNF grammar, told apart by their syntax) or "choice"
            (`source`: a JSON list of strings, the output being one of them).
        source: the schema, expression or grammar text.
        thinking: None, or the thinking the output starts with, which the grammar leaves free
            (see `after`).
        tags: texts a "grammar" `source` refers to as the rules `tag0`, `tag1`, ... (a tool
            call's `<tool_call>`): each may be written as the tokenizer's own token for it,
            where it has one (as its model writes it; llguidance matches such a token only
            as itself), or as text.

    Raises:
        InputError: for an unknown kind, or a source that does not compile; the message says
            what llguidance found.
    """

    kind: str
    source: str = ""
    thinking: Thinking | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.tags and (self.kind != "grammar" or not all(
                isinstance(t, str) and t for t in self.tags)):
            raise InputError("grammar tags are non-empty texts, for a \"grammar\" kind only")
        if self.kind not in GRAMMAR_KINDS:
            raise InputError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got "
                             f"{self.kind!r}")
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise InputError(f"a {self.kind} grammar must be text of at most "
                             f"{MAX_GRAMMAR_CHARS} characters")
        if self.kind != "json_object" and not self.source.strip():
            raise InputError(f"a {self.kind} grammar needs its text")
        error = _llguidance().LLMatcher.validate_grammar(self.compiled())
        if error:
            raise InputError(f"the {self.kind} does not compile: {_one_line(error)}")

    @classmethod
    def json_schema(cls, schema: object) -> Grammar:
        """A JSON schema given as a dict or as JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """The output is exactly one of `options`."""
        return cls("choice", json.dumps(list(options)))

    def after(self, thinking: Thinking) -> Grammar:
        """This grammar for the answer a reasoning model writes after its `thinking`."""
        return replace(self, thinking=thinking)

    def compiled(self, token_of: Callable[[str], int | None] | None = None) -> str:
        """llguidance's grammar definition (of the answer: see `GrammarCompiler.state`), with
        `tags` spelled by `token_of` (a tag's own token id, or None; None: text only)."""
        llg = _llguidance()
        source = self.source + "".join(
            f"\ntag{i}: {_spelled(tag, token_of(tag) if token_of else None)}"
            for i, tag in enumerate(self.tags))
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = _ANY_OBJECT if self.kind == "json_object" else self.source
                return str(llg.LLMatcher.grammar_from_json_schema(json.loads(schema),
                                                                  defaults=_JSON_STYLE))
            if self.kind == "choice":
                choices = json.loads(self.source)
                if not isinstance(choices, list) or not choices or \
                        not all(isinstance(c, str) and c for c in choices):
                    raise ValueError("a choice is a JSON list of non-empty strings")
            return str(llg.grammar_from(self.kind, source))  # "grammar": Lark or GBNF
        except (ValueError, TypeError, RecursionError) as exc:
            raise InputError(f"the {self.kind} does not compile: {_one_line(str(exc))}") \
                from None


def _spelled(tag: str, token: int | None) -> str:
    """A Lark rule body matching `tag`: as its own `token` (when there is one) or as text."""
    return json.dumps(tag) if token is None else f"<[{token}]> | {json.dumps(tag)}"


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " / ".join(lines[:4])[:300]


class GrammarCompiler:
    """A pair's tokenizer as llguidance sees it (built once, on the first grammar: ~0.2 s for a
    49k vocabulary), and the matchers of each generation's grammar.

    Args:
        tokenizer_json: gives the `tokenizers` tokenizer serialized (`Tokenizer.to_json`).
        vocab_size: the target's vocabulary (masks cover padded ids too, never allowed).
        eos_token_ids: the ids that end a generation (allowed where the grammar is complete).
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._json, self.vocab_size = tokenizer_json, vocab_size
        self.eos = [int(t) for t in eos_token_ids]
        self._tokenizer: Any = None
        self._added: dict[str, int] | None = None  # the tokenizer's added tokens, by text
        self._lock = threading.Lock()

    def state(self, grammar: Grammar) -> GrammarState:
        """A fresh matcher for one generation."""
        llg = _llguidance()
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg.LLTokenizer(self._json(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos or None)
            lead = grammar.thinking.lark(self._own_token) if grammar.thinking else None
            tokens = {tag: self._own_token(tag) for tag in grammar.tags}
        source = grammar.compiled(tokens.get)
        matcher = llg.LLMatcher(self._tokenizer,
                                source if lead is None else _after_lead(source, lead),
                                log_level=0)
        if matcher.is_error():
            raise InputError(f"the {grammar.kind} does not compile: "
                             f"{_one_line(matcher.get_error())}")
        return GrammarState(matcher, self.vocab_size, self.eos)

    def _own_token(self, text: str) -> int | None:
        """The id of `text` when the tokenizer has it as a token of its own (an added token,
        which llguidance matches only as itself), else None."""
        if self._added is None:
            added = json.loads(self._json()).get("added_tokens") or []
            self._added = {t["content"]: int(t["id"]) for t in added
                           if isinstance(t, dict) and isinstance(t.get("content"), str)
                           and isinstance(t.get("id"), int) and t["id"] < self.vocab_size}
        token = self._added.get(text)
        return token if token is not None and self._tokenizer.is_special_token(token) else None


def _after_lead(answer: str, lead: str) -> str:
    """llguidance's definition of a `lead` (Lark rules defining `lead`) followed by the
    grammar `answer` (a definition as `Grammar.compiled` writes it: llguidance's JSON, or the
    text of a Lark grammar)."""
    if answer.lstrip().startswith("{"):
        grammars = json.loads(answer)["grammars"]
    else:  # llguidance gives a Lark grammar as its text
        grammars = [{"lark_grammar": answer}]
    start = {"lark_grammar": f"start: lead @{_ANSWER}\n{lead}"}
    return json.dumps({"grammars": [start, dict(grammars[0], name=_ANSWER), *grammars[1:]]})


class GrammarState:
    """One row's matcher, positioned on demand (see the module docstring)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size
        self._eos = np.asarray([t for t in eos_token_ids if t < vocab_size], np.int64)
        self._fed: list[int] = []  # the output tokens the matcher has consumed

    def _follow(self, tokens: Sequence[int]) -> bool:
        """Position the matcher after `tokens` (output tokens); False when one of them breaks
        the grammar (the matcher then stands after the valid prefix)."""
        fed, common = self._fed, 0
        limit = min(len(fed), len(tokens))
        while common < limit and fed[common] == int(tokens[common]):
            common += 1
        if common < len(fed):
            self._matcher.rollback(len(fed) - common)
            del fed[common:]
        rest = [int(t) for t in tokens[common:]]
        valid = self._matcher.validate_tokens(rest) if rest else 0
        if valid:
            self._matcher.consume_tokens(rest[:valid])
            fed.extend(rest[:valid])
        return valid == len(rest)

    def _mask(self) -> npt.NDArray[np.bool_]:
        bits = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if np.count_nonzero(mask) <= _CHECKED:  # a forced path: keep what the matcher takes
            for token in np.flatnonzero(mask):  # (the module docstring)
                if int(token) not in self._eos and \
                        self._matcher.validate_tokens([int(token)]) != 1:
                    mask[token] = False
                    log.warning("structured output: the grammar spells token %d, one of the "
                                "tokenizer's own, which llguidance matches only as itself "
                                "and not as text: the output ends here (write it as <[%d]> "
                                "in a Lark grammar)", token, token)
        if not mask.any():  # a dead end: no token continues the grammar
            if self._matcher.is_error():
                raise InputError(f"structured output failed: "
                                 f"{_one_line(self._matcher.get_error())}")
            mask[self._eos] = True  # end the generation where nothing can follow
        return mask

    def masks(self, history: Sequence[int], drafts: npt.ArrayLike, rows: int
              ) -> npt.NDArray[np.bool_]:
        """`[rows, vocab]` the allowed tokens after `history` and the first i drafts, row i. Rows
        after a draft that breaks the grammar repeat the last valid row (verification never
        reaches them: it rejects that draft). Nothing is allowed after a `history` that breaks
        the grammar (a draft step after an n-gram draft that did: drafting stops there)."""
        out = np.zeros((rows, self.vocab_size), bool)
        drafts = np.asarray(drafts, np.int64)
        ok = self._follow(history)
        if not ok:
            return out
        out[0] = self._mask()
        for i in range(1, rows):
            if ok and self._matcher.validate_tokens([int(drafts[i - 1])]) == 1:
                self._matcher.consume_token(int(drafts[i - 1]))
                self._fed.append(int(drafts[i - 1]))
                out[i] = self._mask()
            else:
                ok = False
                out[i] = out[i - 1]
        return out

    def allowed_prefix(self, history: Sequence[int], drafts: Sequence[int]) -> int:
        """How many of `drafts` the grammar allows after the output `history`, one after the
        other (0 after a `history` that breaks it)."""
        if not self._follow(history):
            return 0
        return int(self._matcher.validate_tokens([int(t) for t in drafts])) if drafts else 0

    def forced(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after the output `history` (llguidance's
        fast-forward tokens: the forced bytes as the tokenizer writes them; none after a
        `history` that breaks the grammar). Drafts, verified as any: the target may write
        those bytes with other tokens."""
        if limit <= 0 or not self._follow(history):
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]

    def constrain(self, logits: npt.ArrayLike, history: Sequence[int],
                  drafts: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """A verification block's logits `[n, vocab]` with each row's disallowed tokens at
        -inf (a shorter draft vocabulary takes the first columns of the masks)."""
        arr = np.asarray(logits)
        masks = self.masks(history, drafts, arr.shape[0])[:, :arr.shape[1]]
        return np.where(masks, arr, -np.inf)

    def constrain_draft(self, logits: npt.ArrayLike, ids: npt.NDArray[np.int64] | None,
                        history: Sequence[int]) -> npt.NDArray[np.float64]:
        """One draft step's logits `[draft_vocab]` masked for the output and drafts `history`
        (`ids`: a reduced head's token ids; None: the first ids of the vocabulary)."""
        arr = np.asarray(logits)
        mask = self.masks(history, (), 1)[0]
        return np.where(mask[ids] if ids is not None else mask[:arr.shape[0]], arr, -np.inf)
