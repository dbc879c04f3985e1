"""Load-time checks of an exported model's files, before and after ONNX Runtime opens them.

The model files are untrusted: the external-data files an ONNX protobuf names must be files the
manifest lists (so they are confined and hashed); a reduced-vocabulary draft's id subset and a
draft's input id map (its own tokenizer's id for each of the pair's) are read without unpickling
and must be ids in range; and the graph must hold the
tensors and shapes the manifest declares (KV heads, head size, logits width), so a mismatched pair
fails at load in one line instead of mid-generation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import ManifestError, ModelError
from .files import confine
from .manifest import MANIFEST_NAME, ModelSpec
from .onnx_file import external_data_files


def check_external_data(root: Path, rel: str, spec: ModelSpec, name: str) -> None:
    """Refuse a model whose tensors read external data from a file the manifest does not
    list (only listed files are confined and hashed)."""
    path = root / rel
    try:
        locations = external_data_files(path)
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise ModelError(
            f"{path}: the {name} model is not a valid ONNX file ({exc}); the file may "
            "be truncated or corrupt: re-export the pair"
        ) from None
    folder = os.path.dirname(rel)
    manifest = root / MANIFEST_NAME
    for location in sorted(locations):
        rel = os.path.normpath(os.path.join(folder, location)).replace(os.sep, "/")
        key = f"models.{name}.files"
        if os.path.isabs(location) or rel.startswith("../") or rel not in spec.files:
            raise ManifestError(
                f"{path}: the {name} model reads external data from {location!r}, "
                f"which {manifest} does not list under {key}; the runtime opens only "
                "listed, hashed files: re-export the pair"
            )
        confine(root, rel, file=manifest, key=f"{key}.{rel}")


def _read_ids(path: Path, count: int, what: str) -> np.ndarray:
    """A 1-D integer `.npy` of at most `count` ids, its header checked before the data is read
    and never unpickled.

    Raises:
        ModelError: unreadable, or the header declares another shape or a non-integer type.
    """
    try:
        with open(path, "rb") as fh:  # the header first: the declared shape must fit
            version = np.lib.format.read_magic(fh)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(fh)
            offset = fh.tell()
        found = shape[0] if len(shape) == 1 else -1
        if not 0 < found <= count or dtype.kind not in "iu" or \
                offset + found * dtype.itemsize != path.stat().st_size:
            raise ValueError(f"its header declares shape {shape} of {dtype}, not up to "
                             f"{count} token ids filling the file")
        ids = np.load(path, allow_pickle=False)  # never unpickle
    except (OSError, ValueError, TypeError, MemoryError) as exc:
        raise ModelError(f"{path}: unreadable {what} ({str(exc)[:200]}); re-export") from None
    return ids  # type: ignore[no-any-return]


def load_vocab_ids(root: Path, spec: ModelSpec) -> np.ndarray | None:
    """Token ids the logits cover, for a reduced-vocabulary draft head (None: all)."""
    if spec.vocab_ids is None:
        return None
    path = root / spec.vocab_ids
    ids = _read_ids(path, spec.vocab_size, "vocabulary subset")
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or \
            ids.min() < 0 or ids.max() >= spec.vocab_size or \
            (np.diff(ids) <= 0).any():
        raise ModelError(f"{path}: the vocabulary subset must be sorted unique token ids "
                         f"in [0, {spec.vocab_size}); re-export the pair")
    return ids.astype(np.int64)


def load_input_id_map(root: Path, spec: ModelSpec) -> np.ndarray | None:
    """The draft's own id for each of the pair's token ids, for a draft with its own tokenizer
    (`ModelSpec.input_id_map`; None: it reads the pair's ids as they are). Each id must lie in
    the draft's embedding table (`ModelSpec.input_vocab_size` rows, where stated).

    Raises:
        ModelError: unreadable, not one id per pair token id, or an id past the draft's table.
    """
    if spec.input_id_map is None:
        return None
    path = root / spec.input_id_map
    ids = _read_ids(path, spec.vocab_size, "input id map")
    limit = spec.input_vocab_size or 1 << 24
    if ids.shape != (spec.vocab_size,) or ids.min() < 0 or ids.max() >= limit:
        raise ModelError(f"{path}: the input id map must hold one id in [0, {limit}) for each "
                         f"of the pair's {spec.vocab_size} token ids; re-export the pair")
    return ids.astype(np.int64)


def check_io(session: ort.InferenceSession, spec: ModelSpec, name: str, out: str, *,
             head_session: ort.InferenceSession | None, expected: int,
             probe_width: Callable[[], int]) -> None:
    """Check that the graph has every tensor the manifest names (`out`: the logits, or the
    hidden state of a body whose head is split off, which `head_session` then runs), that its
    KV inputs have the manifest's heads and head size, and that its logits are `expected` wide
    (`probe_width()` runs it once where the graph leaves the width symbolic).

    Raises:
        ModelError: what differs, and to re-export the pair.
    """
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    pasts = [p.format(i=i) for i in range(spec.num_layers)
             for p in (spec.kv.past_key, spec.kv.past_value)]
    presents = [p.format(i=i) for i in range(spec.num_layers)
                for p in (spec.kv.present_key, spec.kv.present_value)]
    needed_in = [spec.input_ids, spec.attention_mask, *pasts]
    if spec.position_ids:
        needed_in.append(spec.position_ids)
    needed_out = [out, *presents]
    missing = [n for n in needed_in if n not in inputs] + [
        n for n in needed_out if n not in outputs]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more"
                                          if len(missing) > 4 else "")
        raise ModelError(
            f"{spec.path}: the {name} model lacks the tensors the manifest names "
            f"({shown}); re-export the pair"
        )
    for past in pasts:  # [batch, kv_heads, past, head_dim]: the static dims must agree
        shape = inputs[past].shape
        if len(shape) != 4:
            continue
        for dim, key, want in ((1, "num_kv_heads", spec.num_kv_heads),
                               (3, "head_dim", spec.head_dim)):
            if isinstance(shape[dim], int) and shape[dim] != want:
                raise ModelError(
                    f"{spec.path}: the {name} model's {past} has {shape[dim]} "
                    f"at dimension {dim} but the manifest's {key} is {want}; re-export the "
                    "pair"
                )
    vocab = (outputs[spec.logits].shape[-1] if head_session is None
             else head_session.get_outputs()[0].shape[-1])
    if not isinstance(vocab, int):
        vocab = probe_width()
    if vocab != expected:
        raise ModelError(
            f"{spec.path}: the {name} model has {vocab} logits but the "
            f"manifest says {expected}; re-export the pair"
        )
