"""Ragged batch steps of one model: `forward_rows` and `forward_rows_greedy`.

`BatchRows` is a mixin of `OrtModel` (`runtime/backend`): each row of a batch's cache is fed its
own number of new tokens after its own prefix, in one of two forms.

- The concat form (standard ops, `present = concat(past, new)`): one call, the rows' pasts
  padded to the longest with attention-mask holes and only each row's new keys and values kept,
  with the KV cache in host memory (`_run_host_kv`) or on the device (`_run_device_kv`,
  `runtime/device_kv`). `OrtModel`'s own concat-form runs use these two as well.
- The gqa-shared form (ONNX Runtime GenAI's GroupQueryAttention, keys and values written in
  place): the calls the kernel takes, one call as `forward` makes it where every row is fed
  alike, else one token per row over the cache's rows (`_one_each`) and a row's own call on
  views of its slice of the buffers (`_run_span`).

One-token steps of a model with `two_row_steps` run as two rows here too (see
`runtime/backend`). `_host` and `_value` move logits between an OrtValue and host memory for
both modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

from . import host_argmax
from .device_kv import DeviceKV
from .errors import InputError, ModelError
from .greedy_head import GreedyHead
from .kvcache import KVCache
from .manifest import ModelSpec
from .sessions import NO_GRAPH_OPTIONS, NP_DTYPES, SessionConfig
from .shortlist import SplitHead


def _host(logits: ort.OrtValue | np.ndarray) -> np.ndarray:
    """Logits in host memory, owned by the caller (a CPU OrtValue's numpy() is a view)."""
    if isinstance(logits, np.ndarray):
        return logits
    arr = logits.numpy()
    return arr.copy() if logits.device_name().lower() == "cpu" else arr


def _value(logits: ort.OrtValue | np.ndarray) -> ort.OrtValue:
    """Logits as an OrtValue (host arrays are wrapped, not copied)."""
    if isinstance(logits, np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(logits))
    return logits


class BatchRows:
    """The ragged batch steps of `OrtModel`; what they use of it is declared here."""

    spec: ModelSpec
    name: str
    config: SessionConfig
    session: ort.InferenceSession
    split: SplitHead | None
    logits_size: int
    two_row_steps: bool
    calls: int
    _kv_names: list[tuple[str, str]]
    _out: tuple[str, int]
    _step: Callable[[KVCache, np.ndarray], tuple[ort.OrtValue | np.ndarray, int]]
    _embeddable: Callable[[np.ndarray], np.ndarray]
    _head_for: Callable[[ort.OrtValue | np.ndarray], GreedyHead | None]
    _not_finite: Callable[[], ModelError]

    def forward_rows(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray,
                     new_lens: np.ndarray) -> np.ndarray:
        """Ragged batch step: row `rows[i]` of `cache` is fed `tokens[i, :new_lens[i]]`.

        Each row keeps its own length. The rows' pasts are padded to the longest with
        attention-mask holes, the new tokens get per-row position ids, and only each row's
        `new_lens[i]` new keys/values are copied back after its own prefix. Rows of the cache
        that are not in `rows` are neither fed nor paid for. A concat-form graph runs any
        block in one call; an in-place (gqa-shared) graph runs the calls ONNX Runtime's
        GroupQueryAttention takes (CPU and CUDA refuse batch > 1 with several new tokens after
        a past: see `_rows_step_shared`), as a batch's draft does. On a GPU provider the cache
        stays on the device (`runtime/device_kv`).

        Returns:
            logits `[len(rows), tokens.shape[1], vocab]`; entries past `new_lens[i]` are padding.
        """
        logits, valid, skip = self._rows_step(cache, rows, tokens, new_lens)
        out = _host(logits)
        if not math.isfinite(float(out[valid].sum(dtype=np.float64))):
            raise self._not_finite()
        return out[:, skip:] if skip else out

    def feed_rows(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray,
                  new_lens: np.ndarray) -> None:
        """As `forward_rows`, for the keys and values only: no logits reach the host (a
        prefill's earlier chunks)."""
        self._rows_step(cache, rows, tokens, new_lens)

    def forward_rows_greedy(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray,
                            new_lens: np.ndarray, greedy: np.ndarray, *, last: bool = False
                            ) -> tuple[np.ndarray, np.ndarray]:
        """`forward_rows` for a batch where the rows with `greedy[i]` need only the argmax.

        Returns:
            ids `[len(rows), width]` int64: the argmax at each fed position of a greedy row
            (ties to the lowest id), -1 elsewhere (`[len(rows), 1]`, each row's last fed
            position, with `last`); and the logits of the other rows, in order
            `[count(~greedy), width, vocab]`. With `argmax_on_device` the greedy head computes
            both where the logits are, so the greedy rows' logits never reach the host.

        Raises:
            ModelError: NaN or inf logits at a fed position.
        """
        greedy = np.asarray(greedy, dtype=bool)
        new_lens = np.asarray(new_lens, dtype=np.int64)
        logits, valid, skip = self._rows_step(cache, rows, tokens, new_lens)
        valid = valid[:, skip:]
        head = self._head_for(logits)
        if head is not None:
            ids, sums, kept = head.run(_value(logits), np.flatnonzero(~greedy))
            ids, sums, kept = ids[:, skip:], sums[:, skip:], kept[:, skip:]
            if not np.isfinite(sums[valid]).all():
                raise self._not_finite()
            if last:
                ids = ids[np.arange(len(greedy)), new_lens - 1][:, None]
            else:
                ids[~valid] = -1
        else:
            host = _host(logits)[:, skip:]
            keys = host_argmax.order_keys(host)
            if not host_argmax.finite_at(keys, valid):
                raise self._not_finite()
            ids = host_argmax.rows_argmax(keys, greedy, new_lens, last=last)
            kept = host_argmax.floats(host[~greedy] if not greedy.all() else host[:0])
        ids[~greedy] = -1
        return ids, kept

    def _rows_step(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray,
                   new_lens: np.ndarray) -> tuple[ort.OrtValue | np.ndarray, np.ndarray, int]:
        """The run of `forward_rows`: the logits where the run left them (device OrtValue, or
        host array), which positions were fed `[len(rows), width]` bool, and how many leading
        positions are not the caller's (1 when a one-token step ran as two rows, as `_step`)."""
        rows = np.asarray(rows, dtype=np.int64)
        new_lens = np.asarray(new_lens, dtype=np.int64)
        if self.spec.graph == "gqa-shared":
            return self._rows_step_shared(cache, rows, np.asarray(tokens, np.int64), new_lens)
        tokens = self._embeddable(tokens)
        count, width = tokens.shape
        lengths = cache.lengths[rows]
        skip = 0
        if self.two_row_steps and width == 1 and (new_lens == 1).all() and (lengths > 0).all():
            # As in `_step`: every row re-feeds its previous token, so neither the matrix
            # products (one row in all) nor the attention (one new token per row) run a
            # one-row path that the verification blocks never take.
            skip, width = 1, 2
            tokens = np.concatenate([cache.fed[rows, lengths - 1][:, None], tokens], axis=1)
            lengths, new_lens = lengths - 1, new_lens + 1
        if int((lengths + new_lens).max()) > cache.max_len:
            raise InputError(f"{self.name} model: {int((lengths + new_lens).max())} tokens "
                             f"exceed the context of {cache.max_len}")
        # The pasts padded to the longest (gathered), or to the cache's room (bound in place).
        past = cache.padded_past(rows, lengths, lengths + new_lens)
        total = past + width  # the padded attention span; only each row's own tokens are kept
        at = np.arange(total)[None, :]
        mask = ((at < lengths[:, None]) |
                ((at >= past) & (at < past + new_lens[:, None]))).astype(np.int64)
        feeds: dict[str, Any] = {self.spec.input_ids: np.ascontiguousarray(tokens, np.int64),
                                 self.spec.attention_mask: mask}
        if self.spec.position_ids:
            # Padding slots of a short row get clamped positions: masked, never kept, and never
            # past the model's position table (a row near the context limit next to a row with
            # a longer block).
            positions = lengths[:, None] + np.arange(width)[None, :]
            feeds[self.spec.position_ids] = np.minimum(positions, self.spec.max_seq_len - 1)
        try:
            if cache.device_kv is not None:
                logits: ort.OrtValue | np.ndarray = self._run_device_kv(
                    cache, cache.device_kv, rows, feeds, lengths, new_lens, past, width)
            else:
                logits = self._run_host_kv(cache, rows, feeds, lengths, new_lens, past, width)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"the {self.name} model ({self.spec.path}) failed to run "
                             f"({first[:300]}); re-export the pair") from None
        for i, row in enumerate(rows):
            cache.fed[row, lengths[i]:lengths[i] + new_lens[i]] = tokens[i, :new_lens[i]]
        cache.lengths[rows] = lengths + new_lens
        self.calls += 1
        return logits, np.arange(width)[None, :] < new_lens[:, None], skip

    def _rows_step_shared(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray,
                          new_lens: np.ndarray) -> tuple[ort.OrtValue | np.ndarray, np.ndarray,
                                                         int]:
        """`_rows_step` on the in-place (gqa-shared) form, in the calls GroupQueryAttention
        takes (several rows with a past: one new token each; one row: any number):

        - one token per row: one call over the cache's rows (on the CPU, over each run of
          neighbouring rows: `_one_each`), the rows not in `rows` fed a dummy token that their
          length then drops again (the next token they are fed overwrites its keys and values);
        - a row fed several tokens: a call of its own on views of its slice of the buffers,
          or, where fewer calls do it, a one-token call per position.

        Their keys and values go in place: no row's past is gathered or copied. This is how a
        batch's draft steps run on a gqa-shared draft beside a concat-form target (batched
        verification needs the concat form); on a GPU its one-token calls are the batched
        decode steps that CUDA graphs replay (`SessionConfig.cuda_graph`)."""
        count, width = tokens.shape
        everyone = count == cache.batch and bool((rows == np.arange(count)).all())
        if cache.batch == 1 or (everyone and bool((new_lens == width).all())
                                and (width == 1 or not cache.lengths.any())):
            # What `forward` does: one call (a batch's first prompts, all of one length).
            raw, skip = self._step(cache, tokens)
            if self.split is not None:
                raw = self.split.logits(_host(raw))
            # (`skip`: a re-fed leading position, as in the concat form's `valid`)
            return raw, np.arange(width + skip)[None, :] < (new_lens + skip)[:, None], skip
        valid = np.arange(width)[None, :] < new_lens[:, None]
        wide = np.flatnonzero(new_lens > 1)
        single = np.flatnonzero(new_lens == 1)
        out = np.zeros((count, width, self.logits_size), NP_DTYPES[self.spec.logits_dtype])
        if len(wide) + (len(single) > 0) <= width:
            for i in wide:
                n = int(new_lens[i])
                out[i, :n] = self._run_span(cache, int(rows[i]), tokens[i:i + 1, :n])[0]
            if len(single):
                out[single, 0] = self._one_each(cache, rows[single], tokens[single, 0])
        else:
            for j in range(width):
                take = np.flatnonzero(new_lens > j)
                out[take, j] = self._one_each(cache, rows[take], tokens[take, j])
        return out, valid, 0

    def _one_each(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """One token for each of `rows` (distinct); returns their logits `[len(rows), vocab]`
        (host). On a GPU one call over every row of the cache (the rows not in `rows` fed a
        dummy whose length drops again): its cost is the launches, not the rows, and its shapes
        never change, so a CUDA graph replays it. On the CPU, where each row costs its
        arithmetic, a call per run of neighbouring rows (a one-row gap is fed a dummy: cheaper
        than another call), on views of their slice of the buffers."""
        order = np.argsort(rows)
        rows, tokens = rows[order], tokens[order]
        if self.config.device == "cpu" and cache._fixed is None:
            breaks = np.flatnonzero(np.diff(rows) > 2) + 1
            spans = [(int(run[0]), int(run[-1]) + 1) for run in np.split(rows, breaks)]
        else:
            spans = [(0, cache.batch)]
        out = np.empty((len(rows), self.logits_size), NP_DTYPES[self.spec.logits_dtype])
        for lo, hi in spans:
            saved = cache.lengths[lo:hi].copy()
            feed = np.zeros((hi - lo, 1), np.int64)
            inside = (rows >= lo) & (rows < hi)
            feed[rows[inside] - lo, 0] = tokens[inside]
            if (lo, hi) == (0, cache.batch):
                raw, skip = self._step(cache, feed)
                picked = _host(raw)[rows[inside], skip:skip + 1]
                logits = self.split.logits(picked) if self.split is not None else picked.copy()
            else:
                logits = self._run_span(cache, lo, feed)[rows[inside] - lo]
            out[inside] = logits[:, 0]
            idle = np.ones(hi - lo, bool)
            idle[rows[inside] - lo] = False
            cache.lengths[lo:hi][idle] = saved[idle]
        result = np.empty_like(out)
        result[order] = out
        return result

    def _run_span(self, cache: KVCache, lo: int, tokens: np.ndarray) -> np.ndarray:
        """Feed `tokens` `[n_rows, new]` to rows `lo .. lo + n_rows - 1` of a gqa-shared cache
        alone, bound to views of their slice of the buffers (by address, no copy); their logits
        `[n_rows, new, vocab]` (host). Several rows take one token each (GroupQueryAttention)."""
        tokens = self._embeddable(tokens)
        count, new = tokens.shape
        lengths = cache.lengths[lo:lo + count]
        total = int(lengths.max()) + new
        if total > cache.max_len:
            raise InputError(f"{self.name} model: {total} tokens exceed the context of "
                             f"{cache.max_len}")
        spec, cfg = self.spec, self.config
        dtype = np.dtype(NP_DTYPES[spec.kv.dtype])
        row_shape = [spec.num_kv_heads, cache.max_len, spec.head_dim]
        offset = lo * math.prod(row_shape) * dtype.itemsize
        binding = self.session.io_binding()
        for (past, present), value in zip(self._kv_names, cache.values, strict=True):
            ptr, shape = value.data_ptr() + offset, [count, *row_shape]
            binding.bind_input(past, cfg.device, cfg.device_id, dtype, shape, ptr)
            binding.bind_output(present, cfg.device, cfg.device_id, dtype, shape, ptr)
        binding.bind_cpu_input(spec.input_ids, np.ascontiguousarray(tokens, dtype=np.int64))
        binding.bind_cpu_input(spec.attention_mask, (
            np.arange(total)[None, :] < (lengths + new)[:, None]).astype(np.int64))
        if spec.position_ids:
            binding.bind_cpu_input(spec.position_ids,
                                   lengths[:, None] + np.arange(new, dtype=np.int64)[None, :])
        binding.bind_output(self._out[0], cfg.device, cfg.device_id)  # logits, or hidden
        try:
            self.session.run_with_iobinding(binding, NO_GRAPH_OPTIONS if cfg.cuda_graph
                                            else None)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"the {self.name} model ({spec.path}) failed to run "
                             f"({first[:300]}); re-export the pair") from None
        logits = _host(binding.get_outputs()[len(self._kv_names)])
        if self.split is not None:
            logits = self.split.logits(logits)
        for i in range(count):
            cache.fed[lo + i, lengths[i]:lengths[i] + new] = tokens[i]
        cache.lengths[lo:lo + count] = lengths + new
        self.calls += 1
        return logits

    def _run_host_kv(self, cache: KVCache, rows: np.ndarray, feeds: dict[str, Any],
                     lengths: np.ndarray, new_lens: np.ndarray, past: int, width: int
                     ) -> ort.OrtValue | np.ndarray:
        """One concat-form run on a cache kept in host memory: the rows' pasts bound where
        they are (neighbouring rows padded to the cache's room: `runtime/kv_room`) or gathered
        into a staging buffer, the presents written to another (both reused, bound by address),
        then each row's new positions copied after its own prefix. The logits: a new host array
        on the CPU, left on the device elsewhere.

        Nothing as large as the cache is allocated per call. Fresh past and present arrays for
        every layer and call made glibc map and unmap them: 1,800 page faults per call at batch
        8 once a draft's cache was allocated too, and target calls 13% slower."""
        spec, host, r = self.spec, cache.host, len(rows)
        assert host is not None, "a concat-form cache in host memory"
        n, heads, dim = host.shape[0], spec.num_kv_heads, spec.head_dim
        lo = int(rows[0])
        if past == cache.room and bool((rows == np.arange(lo, lo + r)).all()):
            pasts = host[:, lo:lo + r]  # each layer's rows: one contiguous block of the cache
        else:
            pasts = cache.staging("pasts", n * r * heads * past * dim).reshape(
                n, r, heads, past, dim)
            for i, row in enumerate(rows):  # one copy per row, all layers at once
                pasts[:, i] = host[:, row, :, :past]
        presents = cache.staging("presents", n * r * heads * (past + width) * dim).reshape(
            n, r, heads, past + width, dim)
        # The 2 x layers past and present bindings are kept while their buffers and shapes are
        # the last call's (the rounds of a batch at one width): 0.4-0.6 ms a call on this CPU.
        key = (pasts.ctypes.data, pasts.shape, presents.ctypes.data, presents.shape)
        if cache.host_binding is not None and cache.host_binding[0] == key:
            binding = cache.host_binding[1]
        else:
            binding = self.session.io_binding()
            for k, (past_name, present_name) in enumerate(self._kv_names):
                binding.bind_input(past_name, "cpu", 0, host.dtype, pasts[k].shape,
                                   pasts[k].ctypes.data)
                binding.bind_output(present_name, "cpu", 0, host.dtype, presents[k].shape,
                                    presents[k].ctypes.data)
            cache.host_binding = (key, binding)
        for name, arr in feeds.items():  # every call binds the same names anew
            binding.bind_cpu_input(name, np.ascontiguousarray(arr))
        host_logits = None
        if self.config.provider == "cpu":
            host_logits = np.empty((r, width, self.logits_size), NP_DTYPES[spec.logits_dtype])
            binding.bind_output(spec.logits, "cpu", 0, host_logits.dtype, host_logits.shape,
                                host_logits.ctypes.data)
        else:
            binding.bind_output(spec.logits, self.config.device, self.config.device_id)
        self.session.run_with_iobinding(binding)
        for i, row in enumerate(rows):
            start, m = lengths[i], new_lens[i]
            host[:, row, :, start:start + m] = presents[:, i, :, past:past + m]
        if host_logits is not None:
            return host_logits
        return binding.get_outputs()[-1]

    def _run_device_kv(self, cache: KVCache, kv: DeviceKV, rows: np.ndarray,
                       feeds: dict[str, Any],
                       lengths: np.ndarray, new_lens: np.ndarray, past: int, width: int
                       ) -> ort.OrtValue:
        """One concat-form run on a cache kept on the device (`runtime/device_kv`): the rows'
        pasts gathered and bound there, the new positions scattered back in place; the logits
        stay on the device."""
        binding = self.session.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(arr))
        kv.bind(binding, self._kv_names, rows, past)
        kv.bind_presents(binding, self._kv_names, len(rows), past, width)
        # The logits into a value kept per shape, returned as it is (as `_run_shared`).
        logits = cache.device_logits((len(rows), width, self.logits_size))
        binding.bind_ortvalue_output(self.spec.logits, logits)
        self.session.run_with_iobinding(binding)
        kv.commit(rows, lengths, new_lens)
        return logits
