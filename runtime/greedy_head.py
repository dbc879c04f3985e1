"""The greedy head on the device: argmax ids from logits where the model wrote them.

`GreedyHead` runs the shipped graph `data/greedy_head_<dtype>.onnx` (made by
scripts/make_greedy_head_onnx.py) in a session on the model's device: from the logits it gives the
argmax ids (ties to the lowest id, as numpy's argmax), per-position logit sums (the finiteness
check) and the logits of the rows that sample; only these cross to the host.
"""

from __future__ import annotations

import threading
from importlib import resources
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import InputError
from .sessions import NP_DTYPES, SessionConfig, helper_config, start_session


class GreedyHead:
    """The greedy head graph (`data/greedy_head_<dtype>.onnx`, made by
    scripts/make_greedy_head_onnx.py) in a session on a model's device: from logits left where
    the model wrote them, the argmax ids (ties to the lowest id), per-position logit sums (the
    finiteness check) and the rows that sample; only these cross to the host."""

    def __init__(self, config: SessionConfig, logits_dtype: str, vocab: int) -> None:
        if vocab >= 2**24:
            raise InputError(f"the greedy head indexes tokens in float32: a vocabulary of "
                             f"{vocab} is too large; turn device_argmax off")
        path = resources.files(__package__).joinpath(f"data/greedy_head_{logits_dtype}.onnx")
        self.session = start_session(Path(str(path)), helper_config(config), "the greedy head",
                                     "reinstall specedge, or turn device_argmax off")
        self.index = ort.OrtValue.ortvalue_from_numpy(np.arange(vocab, dtype=np.float32),
                                                      config.device, config.device_id)
        self.dtype = NP_DTYPES[logits_dtype]
        self._local = threading.local()  # per thread: its IO binding and output buffers

    def run(self, logits: ort.OrtValue, keep: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids `[rows, positions]` int64, sums `[rows, positions]` float32 and the logits of
        rows `keep` `[len(keep), positions, vocab]`, all in host memory, owned by the caller.

        The outputs go by address into host arrays (no OrtValue wrappers, no second copy); each
        thread keeps its binding and its id / sum buffers per shape (a decode step calls this
        every token, and rebuilding them cost ~20 us a call, measured on the CPU)."""
        local = self._local
        binding = getattr(local, "binding", None)
        if binding is None:
            binding = local.binding = self.session.io_binding()
            binding.bind_ortvalue_input("index", self.index)
            local.buffers, local.bound, local.kept = {}, None, None
        binding.bind_ortvalue_input("logits", logits)
        binding.bind_cpu_input("keep", np.ascontiguousarray(keep, dtype=np.int64))
        rows, positions, vocab = logits.shape()
        shape = (rows, positions)
        buffers = local.buffers.get(shape)
        if buffers is None:
            buffers = local.buffers[shape] = (np.empty(shape, np.int64),
                                             np.empty(shape, np.float32))
        kept = np.empty((len(keep), positions, vocab), self.dtype)
        if local.bound != shape:
            for name, buf in zip(("ids", "sums"), buffers, strict=True):
                binding.bind_output(name, "cpu", 0, buf.dtype, list(shape), buf.ctypes.data)
            local.bound = shape
        if kept.size or local.kept != kept.shape:  # an empty one needs binding once per shape
            binding.bind_output("kept", "cpu", 0, kept.dtype, list(kept.shape),
                                kept.ctypes.data if kept.size else buffers[0].ctypes.data)
            local.kept = kept.shape
        self.session.run_with_iobinding(binding)
        return buffers[0].copy(), buffers[1].copy(), kept
