"""A concat-form model's KV cache kept on its device (the batched rows on a GPU).

A concat-form graph reads each layer's past `[rows, heads, past, head_dim]` and writes a present
one `new` positions longer; its rows are ragged (each has its own valid length) and only some
rows take part in a call. On the CPU the runtime keeps the cache in numpy arrays and gathers /
scatters rows there. On a GPU that would send the whole cache over PCIe twice per call, so here
the cache of all layers is one device tensor `[batch, slots, 2 x layers, heads, head_dim]`
(slots: the cache length plus a bin slot) and two shipped graphs move the rows on the device
(`scripts/make_kv_rows_onnx.py` writes them):

- `gather`: the rows' first `past` positions in the model's layout `[2 x layers, rows, heads,
  past, head_dim]`, into a scratch buffer whose per-layer slices are bound as the past inputs
  (by address: no copy);
- the model writes its presents into a second scratch buffer, again bound per layer by address;
- `scatter`: ScatterND writes each row's new positions at its own length, in place (its output
  is bound to the cache itself). A short row's padding positions go to the bin slot, which no
  gather reads.

Only token ids, masks, positions and slot indices cross from the host; the logits stay on the
device for the greedy head. On the CPU the same code runs (tests) with host buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import onnxruntime as ort

Starter = Callable[[Path, str], ort.InferenceSession]


class KVOps:
    """The gather, scatter, zeros and copy graphs of one KV dtype in sessions on a model's
    device."""

    def __init__(self, dtype: str, start: Starter) -> None:
        self.dtype = np.dtype(dtype).type
        data = resources.files(__package__).joinpath("data")
        self.gather = start(Path(str(data.joinpath(f"kv_gather_{dtype}.onnx"))),
                            "the KV gather graph")
        self.scatter = start(Path(str(data.joinpath(f"kv_scatter_{dtype}.onnx"))),
                             "the KV scatter graph")
        self.zeros = start(Path(str(data.joinpath(f"kv_zeros_{dtype}.onnx"))),
                           "the KV zeros graph")
        self.copy = start(Path(str(data.joinpath(f"kv_copy_{dtype}.onnx"))), "the KV copy graph")


def zero_fill(ops: KVOps, value: ort.OrtValue, device_id: int) -> None:
    """Write zeros over `value` where it is (device `device_id` of its kind; of the zeros
    graph's dtype), bound by address as a flat buffer, whatever its shape.

    A KV buffer must start as zeros, not as whatever the allocator held: attention kernels may
    load a tile's values past a row's length and multiply them by zero weights, and 0 x NaN is
    NaN (flash-attention issues 1745, 2374). No host array as large as the buffer is made."""
    size = math.prod(value.shape())
    fill = ops.zeros.io_binding()
    fill.bind_cpu_input("shape", np.array([size], np.int64))
    fill.bind_output("zeros", value.device_name(), device_id, ops.dtype, [size],
                     value.data_ptr())
    ops.zeros.run_with_iobinding(fill)


def copy_span(ops: KVOps, src: ort.OrtValue, src_at: int, dst: ort.OrtValue, dst_at: int,
              count: int, device_id: int) -> None:
    """Copy `count` elements from element `src_at` of `src` to element `dst_at` of `dst`
    (buffers of the copy graph's dtype on one device, whatever their shapes), where they are:
    the graph's input and output are bound by address over the two spans."""
    if count <= 0:
        return
    size = ops.dtype(0).itemsize
    run = ops.copy.io_binding()
    run.bind_input("x", src.device_name(), device_id, ops.dtype, [count],
                   src.data_ptr() + src_at * size)
    run.bind_output("y", dst.device_name(), device_id, ops.dtype, [count],
                    dst.data_ptr() + dst_at * size)
    ops.copy.run_with_iobinding(run)


class Scratch:
    """A device buffer reused across calls, grown (by a quarter more) when a call needs more."""

    def __init__(self, dtype: type[np.generic], device: str, device_id: int) -> None:
        self.dtype, self.device, self.device_id = dtype, device, device_id
        self.value: ort.OrtValue | None = None
        self.size = 0

    def address(self, elements: int) -> int:
        """The start of a buffer of at least `elements` elements."""
        if self.value is None or elements > self.size:
            self.size = max(elements, self.size + self.size // 4, 1)
            self.value = ort.OrtValue.ortvalue_from_shape_and_type(
                (self.size,), self.dtype, self.device, self.device_id)
        return int(self.value.data_ptr())


class DeviceKV:
    """The KV cache of one concat-form model for `batch` rows of up to `max_len` tokens, on the
    model's device (see the module docstring).

    `bind` prepares a model run (the pasts gathered, past inputs and present outputs bound);
    `commit` writes the run's new positions into the cache. Lengths are the caller's (`KVCache`).
    """

    def __init__(self, ops: KVOps, *, layers: int, heads: int, head_dim: int, batch: int,
                 max_len: int, dtype: type[np.generic], device: str, device_id: int) -> None:
        self.ops, self.batch, self.max_len = ops, batch, max_len
        self.n, self.heads, self.head_dim = 2 * layers, heads, head_dim
        self.dtype, self.device, self.device_id = dtype, device, device_id
        self.itemsize = np.dtype(dtype).itemsize
        # Zeros, not whatever the allocator held: a masked position still multiplies its value
        # by a zero weight, and NaN garbage would make that NaN. Written on the device by a
        # graph (no host array as large as the cache: a Jetson's memory is shared).
        shape = (batch, max_len + 1, self.n, heads, head_dim)
        self.cache = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, device_id)
        zero_fill(ops, self.cache, device_id)
        self._pasts = Scratch(dtype, device, device_id)
        self._presents = Scratch(dtype, device, device_id)
        self._bound: tuple[int, int, int, int] | None = None  # rows, past, width, presents at

    def bind(self, binding: ort.IOBinding, names: Sequence[tuple[str, str]], rows: np.ndarray,
             past: int) -> None:
        """Gather the first `past` positions of `rows` and bind them, by address, as the
        model's past inputs (`bind_presents` binds its outputs)."""
        r = len(rows)
        layer = r * self.heads * past * self.head_dim
        at = self._pasts.address(max(self.n * layer, 1))
        if past:
            gather = self.ops.gather.io_binding()
            gather.bind_ortvalue_input("cache", self.cache)
            gather.bind_cpu_input("rows", np.ascontiguousarray(rows, np.int64))
            gather.bind_cpu_input("past", np.array([past], np.int64))
            gather.bind_output("pasts", self.device, self.device_id, self.dtype,
                               [self.n, r, self.heads, past, self.head_dim], at)
            self.ops.gather.run_with_iobinding(gather)
        shape = [r, self.heads, past, self.head_dim]
        for k, (name, _) in enumerate(names):
            binding.bind_input(name, self.device, self.device_id, self.dtype, shape,
                               at + k * layer * self.itemsize)

    def bind_presents(self, binding: ort.IOBinding, names: Sequence[tuple[str, str]],
                      rows: int, past: int, width: int) -> None:
        """Bind the model's present outputs `[rows, heads, past + width, head_dim]`."""
        layer = rows * self.heads * (past + width) * self.head_dim
        at = self._presents.address(self.n * layer)
        shape = [rows, self.heads, past + width, self.head_dim]
        for k, (_, name) in enumerate(names):
            binding.bind_output(name, self.device, self.device_id, self.dtype, shape,
                                at + k * layer * self.itemsize)
        self._bound = (rows, past, width, at)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions `[0, n)` of row `src` written over row `dst`'s (a row's positions are
        contiguous: one copy)."""
        row = (self.max_len + 1) * self.n * self.heads * self.head_dim
        copy_span(self.ops, self.cache, src * row, self.cache, dst * row,
                  n * self.n * self.heads * self.head_dim, self.device_id)

    def commit(self, rows: np.ndarray, lengths: np.ndarray, new_lens: np.ndarray) -> None:
        """Write the last run's positions `past .. past + new_lens[i]` of each row i at its
        positions `lengths[i] ..` (the rest of its block to the bin slot)."""
        assert self._bound is not None, "commit before bind_presents"
        r, past, width, at = self._bound
        self._bound = None
        j = np.arange(width)[None, :]
        slots = np.empty((r, width, 2), np.int64)
        slots[:, :, 0] = np.asarray(rows, np.int64)[:, None]
        slots[:, :, 1] = np.where(j < new_lens[:, None], lengths[:, None] + j, self.max_len)
        scatter = self.ops.scatter.io_binding()
        scatter.bind_ortvalue_input("cache", self.cache)
        scatter.bind_input("presents", self.device, self.device_id, self.dtype,
                           [self.n, r, self.heads, past + width, self.head_dim], at)
        scatter.bind_cpu_input("past", np.array([past], np.int64))
        scatter.bind_cpu_input("total", np.array([past + width], np.int64))
        scatter.bind_cpu_input("slots", slots)
        scatter.bind_ortvalue_output("cache_out", self.cache)
        self.ops.scatter.run_with_iobinding(scatter)
