"""ONNX Runtime backend: "run these new tokens against this cache, give logits".

One `OrtModel` wraps one InferenceSession (started by `runtime/sessions`, shared by every
generation that uses the pair); each generation owns its `KVCache` (`runtime/kvcache`). The
gqa-shared form (ONNX Runtime GenAI's GroupQueryAttention graphs) writes new keys and values into
the cache in place, through IO binding; the concat form (standard ops, `present = concat(past,
new)`) copies the valid part of the cache each call; it exists for graphs the GQA builder cannot
produce and for batches. A batch's ragged steps, each row fed its own tokens after its own
prefix (`forward_rows`, in either form), are `runtime/batch_rows`, a mixin of `OrtModel`.

On a GPU only what the host needs leaves the device. Greedy one-position steps run the greedy head
(`runtime/greedy_head`) on the logits where the model wrote them and copy back token ids (and the
logits of sampled rows only); blocks, prefills and batches copy their logits to the host's argmax
(`runtime/host_argmax`). With `SessionConfig.cuda_graph` every step of up to `MAX_FIXED_WIDTH`
tokens runs on the cache's fixed buffers and replays a CUDA graph per width. Both give the tokens
of the plain path; on the CPU both run too (tests), without capture.

The model files are untrusted: `runtime/model_checks` checks them before ONNX Runtime opens a
model (the external-data files it names must be files the manifest lists) and after (the
declared shapes must be what the graph holds); a KV cache is allocated only if it fits the memory
available.

A speculative target must compute a position the same way alone (a decode step) and inside a
verification block, or speculation is not the target's decoding (see `rowprobe`).
`rowprobe.probe_rows` measures it at load; a model with `two_row_steps` never runs a one-token
call: a one-token step re-feeds the previous token beside it (its keys and values come out
bit-identical) and keeps the second row's logits.
"""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from . import host_argmax
from .batch_rows import BatchRows, _host, _value
from .device_kv import KVOps
from .errors import InputError, ModelError
from .greedy_head import GreedyHead
from .kvcache import MAX_FIXED_WIDTH, FixedBuffers, KVCache
from .manifest import ModelSpec
from .model_checks import check_external_data, check_io, load_input_id_map, load_vocab_ids
from .providers import fusions_to_skip
from .rowprobe import RowProbe
from .sessions import (
    NO_GRAPH_OPTIONS,
    NP_DTYPES,
    SessionConfig,
    cuda_attention_problem,
    helper_config,
    provider_chain,
    session_options,
    start_session,
)
from .shortlist import SplitHead

log = logging.getLogger(__name__)

_NO_ROWS = np.zeros(0, np.int64)
# The most positions (rows x positions) the greedy head takes the argmax of on the device. On
# the H200 it ran in 0.17-0.25 ms for one position but in 5.2-5.6 ms for 2 to 8 (its broadcast
# compare and reductions over several rows; docs/results/gpu_diag.md), while copying a few
# rows of logits to numpy's argmax cost far less (K=3: 171 tok/s with the argmax on the host,
# 130 with the head; docs/results/gpu_h200.md). One-row steps keep the head.
HEAD_MAX_POSITIONS = 1


class OrtModel(BatchRows):
    """One exported model in an ONNX Runtime session (thread-safe to share between caches)."""

    def __init__(self, root: Path, spec: ModelSpec, name: str, config: SessionConfig) -> None:
        self.spec, self.name, self.config = spec, name, config
        # The head split off the body (see `runtime/shortlist`), where this session can use it:
        # float32 logits only (older exports split fp16 heads too, whose rounded logits tie
        # where the exact argmax does not; exporter/split_head.py).
        head = spec.head if (spec.head is not None and config.split_head
                             and spec.logits_dtype == "float32"
                             and config.provider == "cpu" and spec.graph == "gqa-shared"
                             and not config.fixed and not config.argmax_on_device) else None
        rel = spec.path if head is None else head.body
        path = root / rel
        for model_file in (rel,) if head is None else (rel, head.logits, head.shortlist):
            check_external_data(root, model_file, spec, name)
        self.split: SplitHead | None = None
        if head is not None:
            self.split = SplitHead(root, head, session_options(config), provider_chain(config))
            worst = self.split.check()
            if not worst < 1.0:
                log.warning("%s: the int8 head's error bound does not hold on this build of "
                            "ONNX Runtime (%.2f of it); running the whole graph", rel, worst)
                self.split, head = None, None
                rel = spec.path
                path = root / rel
        self._out = (spec.logits, 0) if head is None else (head.hidden, head.hidden_size)
        problem = cuda_attention_problem(spec, config)
        if problem is not None and problem[0]:
            raise InputError(problem[1])
        self.session = start_session(path, config, f"the {name} model",
                                     "the file may be truncated or corrupt: re-export the pair",
                                     fusions_to_skip(spec.precision, ort.__version__))
        if problem is not None:  # after the start: where CUDA does not start, that error alone
            log.warning("%s", problem[1])
        if config.fixed and spec.graph != "gqa-shared":
            raise InputError(
                f"{path}: fixed buffers and CUDA graphs need a gqa-shared model (the KV cache "
                f"bound in place), but the manifest says {spec.graph!r}; re-export the pair "
                "without --graph concat, or turn cuda_graph off"
            )
        self.vocab_ids = load_vocab_ids(root, spec)
        self.input_id_map = load_input_id_map(root, spec)
        self.logits_size = spec.vocab_size if self.vocab_ids is None else len(self.vocab_ids)
        self._kv_names = [
            (spec.kv.past_key.format(i=i), spec.kv.present_key.format(i=i))
            for i in range(spec.num_layers)
        ] + [
            (spec.kv.past_value.format(i=i), spec.kv.present_value.format(i=i))
            for i in range(spec.num_layers)
        ]
        # Fixed buffers not in use, per (batch, max_len), and the next CUDA graph id.
        self._pool: dict[tuple[int, int], list[FixedBuffers]] = {}
        self._graph_ids = itertools.count(1)
        self._kv_ops: KVOps | None = None
        check_io(self.session, spec, name, self._out[0],
                 head_session=None if self.split is None else self.split.full,
                 expected=self.logits_size, probe_width=self._probe_logits_width)
        self.head = (GreedyHead(config, spec.logits_dtype, self.logits_size)
                     if config.argmax_on_device else None)
        self.calls = 0
        # Run one-token steps as two rows (see `rowprobe.probe_rows`); set by whoever loads it.
        self.two_row_steps = False
        self.row_probe: RowProbe | None = None

    def _probe_logits_width(self) -> int:
        """The logits width of a graph that leaves it symbolic: one 1-token call."""
        cache = KVCache(self, 1, min(2, self.spec.max_seq_len), fixed=False)
        tokens = np.zeros((1, 1), dtype=np.int64)
        mask = np.ones((1, 1), dtype=np.int64)
        try:
            run = self._run_shared if self.spec.graph == "gqa-shared" else self._run_concat
            width = int(_host(run(cache, tokens, mask)).shape[-1])
        except Exception as exc:  # onnxruntime raises its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise ModelError(
                f"{self.spec.path}: the {self.name} model failed a 1-token run at load "
                f"({first}); its logits may not have the manifest's width "
                f"{self.logits_size}: re-export the pair"
            ) from None
        return width

    def steps_note(self) -> str:
        """How this model's one-token steps run, and why (for bench and logs)."""
        if self.row_probe is not None:
            return self.row_probe.describe()
        return ("steps run as two rows (asked for)" if self.two_row_steps
                else "steps run as one row (not probed)")

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        """A cache for `batch` rows of up to `max_len` tokens (at least `min_cache_len`).

        With fixed buffers the length is rounded up to a power of two (at least 64), so that
        generations of similar lengths share pooled buffers and their captured graphs."""
        spec = self.spec
        length = min(spec.max_seq_len, max(max_len or spec.max_seq_len, spec.min_cache_len))
        if self.config.fixed:
            length = min(spec.max_seq_len, max(64, 1 << (length - 1).bit_length()))
        return KVCache(self, batch, length)

    def _take_fixed(self, batch: int, max_len: int) -> FixedBuffers:
        free = self._pool.get((batch, max_len))
        return free.pop() if free else FixedBuffers(self, batch, max_len)

    def kv_ops(self) -> KVOps:
        """The graphs that zero new KV buffers and move a concat-form cache's rows on the
        device (made once)."""
        if self._kv_ops is None:
            own = helper_config(self.config)
            self._kv_ops = KVOps(self.spec.kv.dtype, lambda path, what: start_session(
                path, own, what, "reinstall specedge"))
        return self._kv_ops

    def _give_back(self, fixed: FixedBuffers) -> None:
        self._pool.setdefault((fixed.batch, fixed.max_len), []).append(fixed)

    def forward(self, cache: KVCache, tokens: np.ndarray) -> np.ndarray:
        """Feed `tokens` after each row's cached prefix and return their logits.

        Args:
            cache: this model's cache; every row's length grows by `tokens.shape[1]`.
            tokens: int64 `[batch, new]`.

        Returns:
            logits `[batch, new, vocab]` (float32, host memory).

        Raises:
            InputError: the cache would overflow its length.
            ModelError: the model produced NaN or inf logits.
        """
        raw, skip = self._step(cache, tokens)
        logits = _host(raw)
        if self.split is not None:  # the body's hidden state: the head makes a new array
            logits = self.split.logits(logits[:, skip:])
        elif logits is cache._logits.get(logits.shape):
            # The cache's own buffer, which the next call overwrites.
            logits = logits[:, skip:].copy()
        elif skip:
            logits = logits[:, skip:]
        if not math.isfinite(float(logits.sum(dtype=np.float64))):
            raise self._not_finite()
        return logits

    def feed(self, cache: KVCache, tokens: np.ndarray) -> None:
        """As `forward`, for the keys and values only: no logits leave the run (a prefill's
        earlier chunks)."""
        self._step(cache, tokens)

    def forward_argmax(self, cache: KVCache, tokens: np.ndarray, *, last: bool = False
                       ) -> np.ndarray:
        """As `forward`, but return only the argmax of each position's logits: ids
        `[batch, new]` int64 (ties to the lowest id, as numpy's argmax); `[batch, 1]`, the last
        position's, with `last` (a prefill).

        With `SessionConfig.argmax_on_device` the greedy head takes it where the logits are and
        only the ids cross to the host; otherwise numpy takes it from the host logits, in place
        (no copy). Both give the same ids and raise `ModelError` on NaN or +inf logits (numpy's
        argmax picks either, so checking the picked values is enough; the head also refuses a
        -inf anywhere).
        """
        raw, skip = self._step(cache, tokens)
        if self.split is not None:
            hidden = _host(raw)[:, -1:] if last else _host(raw)[:, skip:]
            if hidden.shape[0] * hidden.shape[1] <= self.split.max_rows:
                ids = self.split.argmax(hidden.reshape(-1, hidden.shape[-1]))
                if ids.min() < 0:
                    raise self._not_finite()
                return ids.reshape(hidden.shape[:2])
            # A wide block: the int8 head's cost grows by the row, the float head's barely.
            raw, skip, last = self.split.logits(hidden), 0, False
        head = self._head_for(raw)
        if head is None:
            # Few, cheap operations: after a run has streamed the weights through the caches,
            # every extra numpy call between two runs costs ~0.1 ms on a small CPU.
            keys = host_argmax.order_keys(_host(raw)[:, -1:] if last else _host(raw)[:, skip:])
            ids = host_argmax.argmax(keys)
            if ids.size == 1 and keys.dtype != np.int16:  # a CPU step: the fewest numpy calls
                finite = math.isfinite(keys.flat[int(ids.flat[0])])
            else:
                finite = host_argmax.picked_finite(keys, ids)
            if not finite:
                raise self._not_finite()
            return ids
        ids, sums, _ = head.run(_value(raw), _NO_ROWS)
        # The positions the caller gets only, as on the host path: a prefill's earlier
        # positions (and a two-row step's re-fed one) are not used, and may overflow on their own.
        used = slice(-1, None) if last else slice(skip, None)
        if not np.isfinite(sums[:, used]).all():
            raise self._not_finite()
        return ids[:, used]

    def _head_for(self, logits: ort.OrtValue | np.ndarray) -> GreedyHead | None:
        """The greedy head for these logits where it pays: logits of at most
        `HEAD_MAX_POSITIONS` positions (rows x positions). Wider calls copy their logits to the
        host for numpy's argmax (the same ids and the same finiteness rule)."""
        if self.head is None:
            return None
        shape = logits.shape if isinstance(logits, np.ndarray) else logits.shape()
        return self.head if shape[0] * shape[1] <= HEAD_MAX_POSITIONS else None

    def _not_finite(self) -> ModelError:
        return ModelError(
            f"the {self.name} model ({self.spec.path}) produced NaN or inf logits; check its "
            "precision (fp16 overflow?) and re-export or re-quantize it"
        )

    def _step(self, cache: KVCache, tokens: np.ndarray
              ) -> tuple[ort.OrtValue | np.ndarray, int]:
        """Run `tokens` after each row's cached prefix. Returns the logits where the run left
        them (an OrtValue on the model's device, or a host array; either may be reused by the
        next call on `cache`) and how many leading positions of them are not the caller's: 1
        when a one-token step ran as two rows (`two_row_steps`), else 0."""
        batch, new = tokens.shape
        tokens = self._embeddable(tokens)
        lengths = cache.lengths
        total = int(lengths.max()) + new
        if total > cache.max_len:
            raise InputError(
                f"{self.name} model: {total} tokens exceed the context of {cache.max_len}"
            )
        skip = 0
        if self.two_row_steps and batch * new == 1 and lengths[0] > 0:
            # Re-feed the previous token: its keys and values come out as they were written
            # (by a call of two or more rows), and the step runs the several-row kernels.
            skip, new = 1, 2
            tokens = np.asarray([[cache.fed[0, lengths[0] - 1], tokens[0, 0]]], np.int64)
            lengths = lengths - 1
            cache.lengths = lengths
        if batch == 1 or (lengths == lengths[0]).all():
            mask = np.ones((batch, total), dtype=np.int64)
        else:
            mask = (np.arange(total)[None, :] < (lengths[:, None] + new)).astype(np.int64)
        try:
            if self.spec.graph == "gqa-shared":
                logits = self._run_shared(cache, tokens, mask)
            else:
                logits = self._run_concat(cache, tokens, mask)
        except Exception as exc:  # onnxruntime raises its own exception types
            cache.lengths = lengths + skip
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(
                f"the {self.name} model ({self.spec.path}) failed to run ({first[:300]}); "
                "the pair may not match this specedge version: re-export it"
            ) from None
        if batch == 1:
            start = int(lengths[0])
            cache.fed[0, start:start + new] = tokens[0]
        else:
            np.put_along_axis(cache.fed, lengths[:, None] + np.arange(new)[None, :],
                              np.asarray(tokens, np.int64), axis=1)
        cache.lengths = lengths + new
        self.calls += 1
        return logits, skip

    def _embeddable(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens` as this model reads them: a draft with its own tokenizer
        (`ModelSpec.input_id_map`) is fed its own id for each; a draft padded to fewer rows
        than its target's vocabulary (`ModelSpec.input_vocab_size`) gets 0 for the ids past
        its table. Only its guesses depend on what it is fed; the target checks every one."""
        if self.input_id_map is not None:
            return self.input_id_map[tokens]  # type: ignore[no-any-return]
        limit = self.spec.input_vocab_size
        if limit is None or int(tokens.max(initial=0)) < limit:
            return tokens
        return np.where(tokens < limit, tokens, 0)

    def _positions(self, cache: KVCache, new: int) -> np.ndarray:
        return cache.lengths[:, None] + np.arange(new, dtype=np.int64)[None, :]

    def _run_shared(self, cache: KVCache, tokens: np.ndarray, mask: np.ndarray
                    ) -> ort.OrtValue | np.ndarray:
        fixed = cache._fixed
        width = tokens.shape[1]
        if fixed is not None and width <= MAX_FIXED_WIDTH and (
                cache.batch == 1 or bool(cache.lengths.any())):
            return self._run_fixed(fixed, cache, tokens)
        binding = cache._binding
        if binding is None:
            # The KV bindings never change: bind them once per cache.
            binding = self.session.io_binding()
            for (past, present), value in zip(self._kv_names, cache.values, strict=True):
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
            cache._binding = binding
        binding.bind_cpu_input(self.spec.input_ids, np.ascontiguousarray(tokens, dtype=np.int64))
        binding.bind_cpu_input(self.spec.attention_mask, mask)
        if self.spec.position_ids:
            binding.bind_cpu_input(self.spec.position_ids, self._positions(cache, width))
        # A session with CUDA graphs must be told that this run (a prefill, a batch's first
        # call or a wide block) is neither captured nor replayed.
        options = NO_GRAPH_OPTIONS if self.config.cuda_graph else None
        if self.config.provider == "cpu" and not self.config.argmax_on_device:
            # Write the logits into a host buffer kept per shape: no per-call allocation, and no
            # Python wrappers for the 2 * layers present outputs (get_outputs would build them).
            # (The hidden state instead, for a body whose head is split off.)
            name, size = self._out
            shape = (tokens.shape[0], width, size or self.logits_size)
            buf = cache._logits.get(shape)
            if buf is None:
                buf = cache._logits[shape] = np.empty(shape, dtype=NP_DTYPES[
                    self.spec.logits_dtype])
            if cache._bound != shape:  # a binding keeps its output until rebound
                binding.bind_output(name, "cpu", 0, buf.dtype, list(shape), buf.ctypes.data)
                cache._bound = shape
            self.session.run_with_iobinding(binding, options)
            return buf
        shape = (tokens.shape[0], width, self.logits_size)
        if width > MAX_FIXED_WIDTH:  # a prefill: its logits are not worth keeping
            binding.bind_output(self.spec.logits, self.config.device, self.config.device_id)
            cache._bound_value = None
            self.session.run_with_iobinding(binding, options)
            # Outputs come back in binding order: the 2*layers presents, then the logits.
            return binding.get_outputs()[len(self._kv_names)]
        # Steps and verification blocks: logits into an OrtValue on the device kept per shape,
        # returned as it is (get_outputs would wrap all 2 * layers presents too: 60 us a call
        # for the reference pair, measured on the CPU, a few percent of a GPU decode step).
        value = cache.device_logits(shape)
        if cache._bound_value is not value:
            binding.bind_ortvalue_output(self.spec.logits, value)
            cache._bound_value = value
        self.session.run_with_iobinding(binding, options)
        return value

    def _run_fixed(self, fixed: FixedBuffers, cache: KVCache, tokens: np.ndarray
                   ) -> ort.OrtValue:
        """A step on the cache's fixed buffers: new contents, same addresses and shapes (the
        mask spans the whole cache), so a CUDA graph captured on them replays."""
        step = fixed.step(tokens.shape[1])
        step.ids.update_inplace(np.ascontiguousarray(tokens, dtype=np.int64))
        fixed.mask_host[:] = np.arange(cache.max_len)[None, :] < (
            cache.lengths + tokens.shape[1])[:, None]
        fixed.mask.update_inplace(fixed.mask_host)
        if step.positions is not None:
            step.positions.update_inplace(self._positions(cache, tokens.shape[1]))
        self.session.run_with_iobinding(step.binding, step.next_run_options())
        return step.logits

    def _run_concat(self, cache: KVCache, tokens: np.ndarray, mask: np.ndarray
                    ) -> ort.OrtValue | np.ndarray:
        past_len = int(cache.lengths.max())
        if (cache.lengths != past_len).any():
            raise InputError("concat-form graphs need equal row lengths; use a gqa-shared pair")
        cache.fit(past_len + tokens.shape[1])  # room for the new positions (rows alike: unpadded)
        feeds: dict[str, Any] = {self.spec.input_ids: tokens.astype(np.int64),
                                 self.spec.attention_mask: mask}
        if self.spec.position_ids:
            feeds[self.spec.position_ids] = self._positions(cache, tokens.shape[1])
        if cache.device_kv is not None:
            rows, new = np.arange(cache.batch), tokens.shape[1]
            return self._run_device_kv(cache, cache.device_kv, rows, feeds, cache.lengths,
                                       np.full(cache.batch, new, np.int64), past_len, new)
        new = tokens.shape[1]
        return self._run_host_kv(cache, np.arange(cache.batch), feeds, cache.lengths,
                                 np.full(cache.batch, new, np.int64), past_len, new)
