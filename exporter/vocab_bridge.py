"""A draft with its own tokenizer: the map that lets it draft for a target of another vocabulary.

Speculative decoding needs the draft's proposals and probabilities in the target's token ids.
With different tokenizers (a Llama draft for a Qwen target, say) this module builds, from the two
vocabularies' bytes, the exact form of Token-Level Intersection (Timor et al., "Accelerating LLM
Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML
2025):

- **Output**: the draft's head keeps only the tokens both vocabularies hold (the same bytes, or
  the same special token; the draft's end of turn stands for the target's), each column read as
  its target id (`vocab_ids`). The draft's distribution is then a distribution over target ids,
  zero elsewhere, so the rejection rule is exact as it is: every output follows the target.
- **Input**: each target id is fed to the draft as its own token of the same bytes, or, where it
  has none, as its longest token that starts those bytes (`input_id_map`). The draft keeps one
  position per target token, so both caches roll back by length alike; a token it reads in part
  only makes its guesses worse, never the output.

The fraction of the target's tokens the draft can propose bounds what it can earn; `specedge
export` prints it and refuses a draft that shares almost nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specedge.runtime.errors import ExportError
from specedge.runtime.files import sha256_file
from specedge.runtime.manifest import ModelSpec
from specedge.runtime.token_bytes import token_bytes

from . import folder_files, sources
from .draft_head import restrict_lm_head
from .split_head import split_head

__all__ = ["MIN_SHARED", "Vocab", "VocabBridge", "bridge", "folder_vocab", "for_folders",
           "write_bridged_draft"]

MIN_SHARED = 0.05  # below this share of the target's tokens a draft can hardly ever be right


@dataclass(frozen=True)
class Vocab:
    """One model's vocabulary as bytes.

    Attributes:
        pieces: the bytes of each token id (None: no token at this id).
        special: the ids of special tokens (matched by their text, never by bytes).
        rows: the model's embedding and logits rows (at least `len(pieces)`).
        end: the id of the tokenizer's eos token (a chat model's end of turn), if any.
        eos: every eos id.
        bos: the bos id, if any.
    """

    pieces: tuple[bytes | None, ...]
    special: frozenset[int]
    rows: int
    end: int | None = None
    eos: tuple[int, ...] = ()
    bos: int | None = None


@dataclass(frozen=True)
class VocabBridge:
    """How a draft of another vocabulary reads and proposes the target's ids.

    Attributes:
        input_map: `[target rows]` the draft id fed for each target id.
        columns: `[shared]` the draft's logits columns kept, in the order of their target ids.
        vocab_ids: `[shared]` the target id of each kept column (sorted, unique).
        exact_inputs: target tokens fed as a draft token of exactly their bytes.
        target_tokens: tokens in the target's vocabulary.
    """

    input_map: np.ndarray
    columns: np.ndarray
    vocab_ids: np.ndarray
    exact_inputs: int
    target_tokens: int

    @property
    def shared(self) -> float:
        """The share of the target's tokens the draft can propose."""
        return len(self.vocab_ids) / max(1, self.target_tokens)

    def summary(self) -> str:
        return (f"the draft has its own tokenizer: it proposes the {len(self.vocab_ids)} tokens "
                f"both vocabularies hold ({self.shared:.0%} of the target's "
                f"{self.target_tokens}) and reads {self.exact_inputs} of the target's tokens "
                "exactly, the rest by their longest prefix")


def bridge(target: Vocab, draft: Vocab) -> VocabBridge:
    """The bridge from `draft`'s vocabulary to `target`'s (a pure function of the two).

    A target token and a draft token pair when they are the same bytes (neither special), or
    the same special token; the target's end of turn (`end`) pairs with the draft's where their
    texts differ. Each draft column stands for at most one target id and the other way round
    (the lowest id wins a tie).
    """
    by_bytes: dict[bytes, int] = {}
    by_text: dict[bytes, int] = {}
    for d, piece in enumerate(draft.pieces[:draft.rows]):  # ids the draft can be fed
        if piece:
            (by_text if d in draft.special else by_bytes).setdefault(piece, d)
    pairs: dict[int, int] = {}  # target id -> draft id of the same token
    for t, piece in enumerate(target.pieces):
        if piece:
            match = (by_text if t in target.special else by_bytes).get(piece)
            if match is not None:
                pairs[t] = match
    if target.end is not None and draft.end is not None:
        pairs.setdefault(target.end, draft.end)
    taken: set[int] = set()
    kept: list[tuple[int, int]] = []
    for t in sorted(pairs):
        if pairs[t] not in taken:
            taken.add(pairs[t])
            kept.append((t, pairs[t]))
    fallback = draft.bos if draft.bos is not None else 0
    input_map = np.full(target.rows, fallback, np.int64)
    exact = 0
    for t, piece in enumerate(target.pieces):
        if t in pairs:
            input_map[t], exact = pairs[t], exact + 1
        elif t in target.eos and draft.end is not None:
            input_map[t] = draft.end  # any end of the target's turn reads as the draft's
        elif t == target.bos and draft.bos is not None:
            input_map[t] = draft.bos
        elif piece:
            input_map[t] = _longest_prefix(piece, by_bytes, fallback)
    tokens = sum(1 for piece in target.pieces if piece)
    return VocabBridge(input_map=input_map,
                       columns=np.asarray([d for _, d in kept], np.int64),
                       vocab_ids=np.asarray([t for t, _ in kept], np.int64),
                       exact_inputs=exact, target_tokens=tokens)


def _longest_prefix(piece: bytes, by_bytes: dict[bytes, int], fallback: int) -> int:
    """The draft token of the longest leading part of `piece` (`fallback`: none at all)."""
    for end in range(len(piece) - 1, 0, -1):
        d = by_bytes.get(piece[:end])
        if d is not None:
            return d
    return fallback


def folder_vocab(folder: Path, rows: int | None, bos: int | None, eos: list[int]) -> Vocab:
    """The vocabulary of an HF folder's fast tokenizer, for a model of `rows` logits (None:
    as many as the tokenizer has ids).

    Raises:
        ExportError: no readable tokenizer.json (`folder_files.tokenizer_vocab`).
    """
    from tokenizers import Tokenizer

    folder_files.tokenizer_vocab(folder)  # the checks and the one-line errors of a bad file
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    rows = size if rows is None else rows
    size = min(rows, size)
    pieces = tuple(token_bytes(tok, i) or None for i in range(size))
    special = frozenset(i for i, added in tok.get_added_tokens_decoder().items()
                        if added.special and i < size)
    end = None
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        name = folder_files.read_json_file(config_file).get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        end = tok.token_to_id(name) if isinstance(name, str) else None
    if end is None and eos:
        end = eos[0]
    return Vocab(pieces=pieces, special=special, rows=rows, end=end, eos=tuple(eos), bos=bos)


def for_folders(target: Path, draft: Path, target_rows: int | None = None,
                draft_rows: int | None = None) -> VocabBridge:
    """The bridge from the tokenizer of HF folder `draft` to `target`'s, for models of these
    logits rows (None: as many as each tokenizer has ids).

    Raises:
        ExportError: a folder lacks a readable tokenizer or an eos id, or the draft shares under
            `MIN_SHARED` of the target's tokens.
    """
    vocabs = []
    for folder, rows in ((target, target_rows), (draft, draft_rows)):
        bos, eos, _ = sources.special_tokens(folder, folder_files.read_config(folder))
        vocabs.append(folder_vocab(folder, rows, bos, eos))
    found = bridge(*vocabs)
    if found.shared < MIN_SHARED:
        raise ExportError(
            f"draft {draft} shares only {len(found.vocab_ids)} of target {target}'s "
            f"{found.target_tokens} tokens ({found.shared:.1%}); it could hardly ever propose "
            "what the target writes: pick a draft whose tokenizer is closer to the target's"
        )
    return found


def write_bridged_draft(tmp: Path, work: Path, draft: ModelSpec, found: VocabBridge,
                        vocab_size: int) -> ModelSpec:
    """Make the exported draft in pair folder `tmp` read and propose target ids: its head
    keeps the shared columns (`draft_head.restrict_lm_head`, then split afresh), and the
    bridge's id files are written beside it. Returns its spec in a pair of `vocab_size` ids.

    Raises:
        ExportError: its logits do not come from a MatMul head that can be restricted.
    """
    model = tmp / draft.path
    folder = model.parent
    staged = work / "draft-bridged" / model.name
    restrict_lm_head(model, staged, found.columns, draft.logits)
    for rel in draft.files:  # the model, its data and any split head: rewritten below
        (tmp / rel).unlink(missing_ok=True)
    for path in staged.parent.iterdir():
        path.replace(folder / path.name)
    rel_dir = Path(draft.path).parent
    files = {str(rel_dir / path.name): sha256_file(path) for path in sorted(folder.iterdir())}
    spec = split_head(tmp, dataclasses.replace(draft, files=files, head=None,
                                               vocab_size=len(found.columns)))
    extra = {}
    for name, array in (("vocab_ids.npy", found.vocab_ids), ("input_id_map.npy",
                                                             found.input_map)):
        np.save(folder / name, array, allow_pickle=False)
        extra[str(rel_dir / name)] = sha256_file(folder / name)
    source = {**spec.source, "vocab_bridge": {
        "proposes": len(found.vocab_ids), "target_tokens": found.target_tokens,
        "read_exactly": found.exact_inputs}}
    return dataclasses.replace(spec, files={**spec.files, **extra}, vocab_size=vocab_size,
                               source=source,
                               vocab_ids=str(rel_dir / "vocab_ids.npy"),
                               input_id_map=str(rel_dir / "input_id_map.npy"),
                               input_vocab_size=draft.vocab_size)
