"""KV caches: the buffers one model's generation keeps its keys and values in.

A `KVCache` holds one model's cache for one generation (one or more rows) with a valid length per
row; rollback shortens the lengths, nothing is recomputed or copied. For the gqa-shared form (ONNX
Runtime GenAI's GroupQueryAttention graphs) it is one preallocated `[batch, kv_heads, max_len,
head_dim]` OrtValue per layer and tensor on the model's device, bound as both past input and
present output so the model writes new keys and values in place. For the concat form it is one
host array, or a `DeviceKV` on the model's device (`runtime/device_kv`).

With fixed buffers (`SessionConfig.fixed`, always with CUDA graphs) the buffers and every step's
inputs and outputs live at fixed addresses (`FixedBuffers`, a `FixedStep` per block width); each
width is captured once as a CUDA graph and replayed, and the model pools the buffers per (rows,
length) so later generations replay the same graphs. A cache is allocated only if it fits the
memory available. `runtime/backend` runs the model on these buffers.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from . import kv_room
from .device_kv import DeviceKV, copy_span, zero_fill
from .errors import InputError, ModelError
from .sessions import NO_GRAPH_OPTIONS, NP_DTYPES, graph_run_options

if TYPE_CHECKING:
    from .backend import OrtModel

MAX_FIXED_WIDTH = 16  # widest step run on fixed buffers (a graph each); wider: plain runs
KEPT_LOGITS = 8  # logits shapes a cache keeps on the device (steps, blocks, batch sizes)
# Devices whose in-place (gqa-shared) KV buffers are zero-filled when allocated, not left with
# the allocator's leftovers: GPU attention kernels may load values past a row's length and
# multiply them by zero weights (0 x NaN = NaN; flash-attention issues 1745, 2374), and on the
# H200 random-weight fp16 pairs refused NaN logits in a process that had run another pair
# before, and ran in a fresh one (docs/results/gpu_findings.md). ONNX Runtime's CPU kernel reads
# only the valid positions, and there the fill would cost 1.6-22 ms per generation (128-2048
# tokens of the reference pair, measured).
ZERO_KV_DEVICES = frozenset({"cuda"})
GRAPH_WARMUP_RUNS = 2  # plain runs of a width before its CUDA graph is captured (ORT's minimum)


def available_memory(device: str) -> int | None:
    """Bytes this process can still allocate on `device` (None: unknown, e.g. a GPU)."""
    if device != "cpu":
        return None
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            used = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf(
                "SC_PAGE_SIZE")
        except (OSError, ValueError):
            used = 0
        avail = min(avail if avail is not None else limit, max(0, limit - used))
    return avail


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 26 else f"{n / (1 << 20):.1f} MiB"


def _allocate_kv(model: OrtModel, batch: int, max_len: int
                 ) -> tuple[np.ndarray | None, list[ort.OrtValue], DeviceKV | None]:
    """A model's KV buffers for `batch` rows of `max_len` tokens: OrtValues on the model's
    device (gqa-shared), or for the concat form one `DeviceKV` on the model's device
    (`SessionConfig.kv_on_device`) or one host array `[2 x layers, batch, heads, max_len,
    head_dim]` (the layers' keys, then their values, in `_kv_names` order).

    Raises:
        InputError: they would not fit the memory available.
        ModelError: the allocation failed.
    """
    spec = model.spec
    dtype = NP_DTYPES[spec.kv.dtype]
    shape = (batch, spec.num_kv_heads, max_len, spec.head_dim)
    need = 2 * spec.num_layers * math.prod(shape) * np.dtype(dtype).itemsize
    avail = available_memory(model.config.device)
    if avail is not None and need > avail:
        raise InputError(
            f"the {model.name} model's KV cache needs {_gib(need)} ({batch} row(s) x "
            f"{max_len} tokens) but {_gib(avail)} of memory is available; ask for fewer "
            "new tokens (or rows), or free memory"
        )
    values: list[ort.OrtValue] = []
    ops = model.kv_ops() if spec.graph == "concat" and model.config.kv_on_device else None
    try:
        if ops is not None:
            return None, values, DeviceKV(
                ops, layers=spec.num_layers, heads=spec.num_kv_heads,
                head_dim=spec.head_dim, batch=batch, max_len=max_len, dtype=dtype,
                device=model.config.device, device_id=model.config.device_id)
        if spec.graph != "gqa-shared":  # every layer's keys, then values: [2 x layers, *shape]
            return np.zeros((2 * spec.num_layers, *shape), dtype=dtype), values, None
        for _ in range(2 * spec.num_layers):
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, dtype, model.config.device, model.config.device_id)
            if model.config.device in ZERO_KV_DEVICES:
                zero_fill(model.kv_ops(), value, model.config.device_id)
            values.append(value)
    except Exception as exc:  # MemoryError, onnxruntime's allocation failures
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ModelError(
            f"the {model.name} model: could not allocate its KV cache of {_gib(need)} "
            f"({batch} row(s) x {max_len} tokens: {first}); ask for fewer new tokens (or "
            "rows), or free memory"
        ) from None
    return None, values, None


class KVCache:
    """Preallocated KV buffers of one model for one generation, with a valid length per row.

    Invariant: positions `[0, lengths[b])` of row b hold the keys/values of the tokens fed so
    far; anything beyond is garbage that the attention mask hides. Rollback shortens `lengths`.

    With fixed buffers (CUDA graphs) the buffers come from the model's pool and go back to it when
    the cache is dropped, so the next generation replays the graphs captured on them.
    """

    def __init__(self, model: OrtModel, batch: int, max_len: int, *,
                 fixed: bool | None = None) -> None:
        spec = model.spec
        if not 1 <= max_len <= spec.max_seq_len:
            raise InputError(f"cache length {max_len} outside [1, {spec.max_seq_len}]")
        self.model, self.batch, self.max_len = model, batch, max_len
        self.lengths = np.zeros(batch, dtype=np.int64)
        self.host: np.ndarray | None = None  # the concat form's cache in host memory
        # The concat form: positions each row has room for (the host array's sequence axis, a
        # view of the first part of one buffer of `max_len`; `runtime/kv_room`).
        self.room = max_len
        self._pads = False  # see `_allocate`
        self.values: list[ort.OrtValue] = []
        self.device_kv: DeviceKV | None = None
        self._fixed: FixedBuffers | None = None
        if model.config.fixed if fixed is None else fixed:
            self._fixed = model._take_fixed(batch, max_len)
            self.values = self._fixed.values
        else:
            self._allocate()  # first: it checks the memory, which `fed` then fits
        # The token fed at each position (a one-token step of a two-row model re-feeds one).
        self.fed = np.zeros((batch, max_len), dtype=np.int64)
        self._binding: Any = None
        self._staging: dict[str, np.ndarray] = {}  # host concat form: reused per-call buffers
        # The host concat form's last KV binding, keyed by its buffers' addresses and shapes.
        self.host_binding: tuple[tuple[Any, ...], Any] | None = None
        self._logits: dict[tuple[int, int, int], np.ndarray] = {}
        # Logits OrtValues on the model's device for the last KEPT_LOGITS shapes (oldest first).
        self._device_logits: dict[tuple[int, int, int], ort.OrtValue] = {}
        self._bound_value: ort.OrtValue | None = None  # the one bound on _binding
        self._bound: tuple[int, int, int] | None = None  # the logits shape bound on _binding

    def device_logits(self, shape: tuple[int, int, int]) -> ort.OrtValue:
        """An OrtValue on the model's device for logits of `shape`, the same one as the last
        call of that shape (the next call of the shape overwrites it); the last `KEPT_LOGITS`
        shapes are kept (a batch's rows and block widths vary)."""
        value = self._device_logits.pop(shape, None)
        if value is None:
            cfg = self.model.config
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, NP_DTYPES[self.model.spec.logits_dtype], cfg.device, cfg.device_id)
        self._device_logits[shape] = value
        while len(self._device_logits) > KEPT_LOGITS:
            del self._device_logits[next(iter(self._device_logits))]
        return value

    def staging(self, name: str, elements: int) -> np.ndarray:
        """A flat host buffer of at least `elements` KV elements, reused from call to call and
        grown (by a quarter more) when a call needs more."""
        buf = self._staging.get(name)
        if buf is None or buf.size < elements:
            size = max(elements, 0 if buf is None else buf.size + buf.size // 4, 1)
            buf = self._staging[name] = np.empty(size, NP_DTYPES[self.model.spec.kv.dtype])
        return buf[:elements]

    def _allocate(self) -> None:
        self.host, self.values, self.device_kv = _allocate_kv(self.model, self.batch,
                                                              self.max_len)
        # Batched calls pad their rows to the room and bind them in place: a host cache of an
        # fp32 model (`kv_room.pads`). A device cache (`runtime/device_kv`) is gathered on the
        # device whatever the padding, so it is never padded.
        self._pads = self.host is not None and kv_room.pads(self.model.spec)
        if self.host is not None and self._pads:
            self.room = kv_room.room_for(0, self.max_len)
            self._buffer = self.host.reshape(-1)
            self.host = self._host_view()

    def _host_view(self) -> np.ndarray:
        """The concat form's host cache `[2 x layers, batch, heads, room, head_dim]`."""
        n, batch, heads, _, dim = self._buffer_shape
        return self._buffer[:n * batch * heads * self.room * dim].reshape(
            n, batch, heads, self.room, dim)

    @property
    def _buffer_shape(self) -> tuple[int, int, int, int, int]:
        spec = self.model.spec
        return (2 * spec.num_layers, self.batch, spec.num_kv_heads, self.max_len,
                spec.head_dim)

    def fit(self, longest: int) -> None:
        """Give the concat form's rows room for `longest` positions (or no more than they
        need: `kv_room.next_room`), re-laying the host cache in place when the room changes."""
        if not self._pads:
            return  # the room stays the whole context
        room = kv_room.next_room(self.room, max(longest, int(self.lengths.max())),
                                 self.max_len)
        if room != self.room:
            n, batch, heads, _, dim = self._buffer_shape
            kv_room.restride(self._buffer, n * batch * heads, self.room, room, dim)
            self.room = room
            self.host = self._host_view()

    def padded_past(self, rows: np.ndarray, lengths: np.ndarray, ends: np.ndarray) -> int:
        """The past a concat-form call of `rows` pads their pasts to (valid `lengths`, each
        holding `ends` positions after it), having given them room (`fit`): `kv_room`."""
        if not self._pads:
            return int(lengths.max())
        self.fit(int(ends.max()))
        contiguous = bool((np.diff(rows) == 1).all())
        return kv_room.padded_past(self.room, lengths, contiguous)

    def __del__(self) -> None:
        fixed = getattr(self, "_fixed", None)
        if fixed is not None:
            self._fixed = None
            self.model._give_back(fixed)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make row `dst` hold row `src`'s first `n` positions (keys, values and the tokens fed),
        bit for bit, with length `n`: a prefix two rows share is computed once."""
        if not 0 < n <= min(int(self.lengths[src]), self.max_len) or src == dst:
            raise AssertionError(f"copy of {n} positions from row {src} (length "
                                 f"{self.lengths[src]}) to row {dst}")
        if self.host is not None:
            self.host[:, dst, :, :n] = self.host[:, src, :, :n]
        elif self.device_kv is not None:
            self.device_kv.copy_prefix(src, dst, n)
        else:  # in place: each value `[batch, heads, max_len, head_dim]`, a span per head
            ops, spec = self.model.kv_ops(), self.model.spec
            dim, heads = spec.head_dim, spec.num_kv_heads
            for value in self.values:
                for h in range(heads):
                    copy_span(ops, value, ((src * heads + h) * self.max_len) * dim, value,
                              ((dst * heads + h) * self.max_len) * dim, n * dim,
                              self.model.config.device_id)
        self.fed[dst, :n] = self.fed[src, :n]
        self.lengths[dst] = n

    def same_layout(self, other: KVCache) -> bool:
        """`other` holds its keys and values as this cache does (layers, heads, head size,
        dtype, device, rows; either graph form on the CPU, where a concat-form host array and
        gqa-shared buffers hold a position alike): `copy_from` can take its positions."""
        a, b = self.model.spec, other.model.spec
        device = self.model.config.device
        return (a.num_layers, a.num_kv_heads, a.head_dim, a.kv.dtype,
                device, self.model.config.device_id, self.batch) == \
            (b.num_layers, b.num_kv_heads, b.head_dim, b.kv.dtype,
             other.model.config.device, other.model.config.device_id, other.batch) and \
            (a.graph == b.graph or device == "cpu") and \
            self.device_kv is None and other.device_kv is None

    def copy_from(self, other: KVCache, start: int, end: int, row: int = 0) -> None:
        """Take positions `[start, end)` of `other`'s row `row` (a cache of `same_layout`) as
        this cache's row `row`, which then holds `end` positions: keys and values another model
        of the same shapes computed for these tokens (a self-draft's prompt, from its target's
        prefill)."""
        if not (self.same_layout(other) and 0 <= start == int(self.lengths[row]) <= end
                <= min(int(other.lengths[row]), self.max_len)):
            raise AssertionError(f"copy of positions [{start}, {end}) into a row of length "
                                 f"{self.lengths[row]} from one of {other.lengths[row]}")
        if self.host is not None or other.host is not None:  # one of them on the host (CPU)
            self.fit(end)
            for i in range(2 * self.model.spec.num_layers):
                self.cpu_layer(i)[row, :, start:end] = other.cpu_layer(i)[row, :, start:end]
        else:  # in place: each value `[batch, heads, max_len, head_dim]`, a span per head
            ops, spec = self.model.kv_ops(), self.model.spec
            dim, heads = spec.head_dim, spec.num_kv_heads
            for mine, theirs in zip(self.values, other.values, strict=True):
                for h in range(heads):
                    copy_span(ops, theirs, ((row * heads + h) * other.max_len + start) * dim,
                              mine, ((row * heads + h) * self.max_len + start) * dim,
                              (end - start) * dim, self.model.config.device_id)
        self.fed[row, start:end] = other.fed[row, start:end]
        if self.batch == 1:
            self.lengths = np.array([end], dtype=np.int64)
        else:
            self.lengths[row] = end

    def cpu_layer(self, i: int) -> np.ndarray:
        """Value `i` (`_kv_names` order) of a CPU cache as an array `[batch, heads, max_len,
        head_dim]`: the concat form's host slice, or a view of the gqa-shared OrtValue's
        memory (writes go to the buffer the model reads)."""
        if self.host is not None:
            return self.host[i]
        if self.model.config.device != "cpu" or not self.values:
            raise AssertionError("cpu_layer reads a CPU cache")
        spec = self.model.spec
        dtype = np.dtype(NP_DTYPES[spec.kv.dtype])
        shape = (self.batch, spec.num_kv_heads, self.max_len, spec.head_dim)
        memory = (ctypes.c_char * (math.prod(shape) * dtype.itemsize)).from_address(
            self.values[i].data_ptr())
        return np.frombuffer(memoryview(memory), dtype=dtype).reshape(shape)

    def rollback(self, lengths: np.ndarray | int) -> None:
        """Set the valid length of each row (O(1): nothing is recomputed or copied)."""
        if isinstance(lengths, int | np.integer) and self.batch == 1:
            if not 0 <= lengths <= self.lengths[0]:
                raise AssertionError(f"rollback to {lengths} from {self.lengths}: can only shrink")
            self.lengths = np.array([lengths], dtype=np.int64)
            return
        new = np.broadcast_to(np.asarray(lengths, dtype=np.int64), self.lengths.shape)
        if (new > self.lengths).any() or (new < 0).any():
            raise AssertionError(f"rollback to {new} from {self.lengths}: can only shrink")
        self.lengths = new.copy()


class FixedStep:
    """The buffers of one block width in a `FixedBuffers`: token ids, position ids and logits,
    an IO binding over them (and the KV and mask buffers), and the CUDA graph it replays."""

    def __init__(self, model: OrtModel, fixed: FixedBuffers, width: int,
                 graph_id: int | None) -> None:
        spec, cfg = model.spec, model.config
        shape = (fixed.batch, width)
        self.ids = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.int64, cfg.device,
                                                             cfg.device_id)
        self.positions = ort.OrtValue.ortvalue_from_shape_and_type(
            shape, np.int64, cfg.device, cfg.device_id) if spec.position_ids else None
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type(
            (fixed.batch, width, model.logits_size), NP_DTYPES[spec.logits_dtype], cfg.device,
            cfg.device_id)
        self.binding = model.session.io_binding()
        for (past, present), value in zip(model._kv_names, fixed.values, strict=True):
            self.binding.bind_ortvalue_input(past, value)
            self.binding.bind_ortvalue_output(present, value)
        self.binding.bind_ortvalue_input(spec.input_ids, self.ids)
        self.binding.bind_ortvalue_input(spec.attention_mask, fixed.mask)
        if self.positions is not None and spec.position_ids:
            self.binding.bind_ortvalue_input(spec.position_ids, self.positions)
        self.binding.bind_ortvalue_output(spec.logits, self.logits)
        self.graph_id = graph_id
        self.run_options = graph_run_options(graph_id)
        # Runs left before this width's graph is captured: ONNX Runtime's CUDA EP counts its
        # warm-up runs per thread, not per graph id (1.31's PerThreadContext), so without these
        # a new width would be captured on its first run at new shapes, when its kernels may
        # still allocate (flash attention's scratch, the memory pattern): not allowed in capture.
        self.warmup = GRAPH_WARMUP_RUNS if graph_id is not None else 0

    def next_run_options(self) -> ort.RunOptions | None:
        """The run options for this step's next run: out of capture while it warms up."""
        if self.warmup:
            self.warmup -= 1
            return NO_GRAPH_OPTIONS
        return self.run_options


class FixedBuffers:
    """A cache's buffers at fixed addresses: the KV buffers, the attention mask at the cache's
    full length `[batch, max_len]` (ones over each row's valid prefix and new tokens, zeros
    after, so its shape never changes), and a `FixedStep` per block width. A CUDA graph captured
    on them replays with new contents, never new addresses; the model pools them per
    (batch, max_len) for the next generation."""

    def __init__(self, model: OrtModel, batch: int, max_len: int) -> None:
        self.model, self.batch, self.max_len = model, batch, max_len
        self.values: list[ort.OrtValue] = _allocate_kv(model, batch, max_len)[1]
        cfg = model.config
        self.mask = ort.OrtValue.ortvalue_from_shape_and_type((batch, max_len), np.int64,
                                                              cfg.device, cfg.device_id)
        self.mask_host = np.zeros((batch, max_len), np.int64)
        self.steps: dict[int, FixedStep] = {}

    def step(self, width: int) -> FixedStep:
        step = self.steps.get(width)
        if step is None:
            graph_id = next(self.model._graph_ids) if self.model.config.cuda_graph else None
            step = self.steps[width] = FixedStep(self.model, self, width, graph_id)
        return step
