"""ONNX Runtime backend: "run these new tokens against this cache, give logits".

One `OrtModel` wraps one InferenceSession (shared by every generation that uses the pair); each
generation owns its `KVCache`. For the `gqa-shared` graph form (ONNX Runtime GenAI's
GroupQueryAttention graphs) the cache is one preallocated `[batch, kv_heads, max_len, head_dim]`
OrtValue per layer and tensor, bound with IO binding as *both* past input and present output: the
model writes the new keys/values in place, nothing is copied, and rollback is setting a shorter
length (the attention mask says how many cached positions are valid). On CUDA the buffers live on
the device. The `concat` form (standard ops, `present = concat(past, new)`) copies the valid part
of the cache each call; it exists for graphs the GQA builder cannot produce.

On a GPU only what the host needs leaves the device. Greedy verification (`forward_argmax`,
`forward_rows_greedy`) runs a tiny shipped graph (`GreedyHead`, `data/greedy_head_*.onnx`) on the
logits where the model wrote them and copies back token ids (and the logits rows of sampled rows
only). With `SessionConfig.cuda_graph` every step of up to `MAX_FIXED_WIDTH` tokens runs on buffers
fixed per cache and width (`FixedBuffers`: the attention mask spans the whole cache, so its shape
never changes), each width is captured once as a CUDA graph (`gpu_graph_id`, after
`GRAPH_WARMUP_RUNS` plain runs at its shapes) and replayed, and the buffers are pooled per (rows,
length) so later generations replay the same graphs. Both give the tokens of the plain path; on the
CPU both run too (tests), without capture.

The model files are untrusted: before ONNX Runtime opens a model, the external-data files the
ONNX protobuf names are read from it (`external_data_files`) and must be files the manifest lists
(hence confined and hashed); the declared shapes (KV heads, head size, logits width, a reduced
vocabulary's size) must match what the graph holds, and a KV cache is allocated only if it fits
the memory available.

A speculative target must compute a position the same way alone (a decode step) and inside a
verification block, or speculation is not the target's decoding (see `rowprobe`).
`OrtModel.probe_rows` measures it at load; a model with `two_row_steps` never runs a one-token
call: a one-token step re-feeds the previous token beside it (its keys and values come out
bit-identical) and keeps the second row's logits.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import resource
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from . import host_argmax
from .device_kv import DeviceKV, KVOps, zero_fill
from .errors import InputError, ManifestError, ModelError
from .manifest import MANIFEST_NAME, ModelSpec, confine
from .onnx_file import external_data_files
from .rowprobe import RowProbe
from .shortlist import SplitHead

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_NP_DTYPES: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16}
THREADS_PER_CORE = 4  # more intra-op threads than this per core only adds contention
log = logging.getLogger(__name__)

# ONNX Runtime's own log: 0 verbose .. 3 error, 4 fatal. Its messages duplicate the one-line
# errors specedge raises, so they are off unless asked for (`specedge -v`, `set_log_severity`).
_log_severity = 4


def set_log_severity(severity: int) -> None:
    """ONNX Runtime's log level for sessions created from now on (0 verbose .. 4 fatal only)."""
    global _log_severity
    _log_severity = max(0, min(4, int(severity)))
    ort.set_default_logger_severity(_log_severity)


def max_threads() -> int:
    """The most intra-op threads a session may have: a small multiple of the usable cores."""
    return THREADS_PER_CORE * physical_cores()


@dataclass(frozen=True)
class SessionConfig:
    """How one model's ONNX Runtime session is created.

    Attributes:
        provider: "cpu", "cuda" or "tensorrt".
        intra_op_threads: threads for one operator; 0 lets ONNX Runtime pick (all cores).
        allow_spinning: whether idle intra-op threads busy-wait. Two sessions that run one after
            the other on the same cores must not spin, or the idle one steals the busy one's cores.
        graph_optimization: "all", "extended", "basic" or "disable".
        device_id: GPU ordinal for CUDA / TensorRT.
        trt_cache_dir: where the TensorRT EP keeps its engine cache (inside the pair folder).
        shared_pool: run on the process-wide ONNX Runtime thread pool (created on first use
            with `intra_op_threads` threads) instead of a pool per session. Sessions that take
            turns on the same cores then share one set of spinning threads and never fight.
        device_argmax: greedy verification takes the argmax where the logits are (the shipped
            `data/greedy_head_*.onnx` graph on the model's provider) and copies only token ids
            to the host. None: on for cuda / tensorrt, off for cpu (there the logits are on the
            host already, and the extra session run costs more than numpy's argmax saves).
            The tokens are the same either way (ties go to the lowest id, as numpy's argmax).
        cuda_graph: capture each fixed-width step of a gqa-shared model as a CUDA graph and
            replay it (the CUDA EP's `enable_cuda_graph`; one graph per block width and cache,
            run option `gpu_graph_id`). Needs provider "cuda"; implies `fixed_buffers`.
        fixed_buffers: bind every input and output of a step to buffers preallocated per cache
            and width, and the attention mask at the cache's full length (the fixed addresses and
            shapes a CUDA graph replays). Implied by `cuda_graph`; on its own it runs the same
            steps without graphs (how the CPU tests check the layout token for token).
        device_kv: keep a concat-form model's KV cache on its device and move rows there
            (`runtime/device_kv`); None: on for cuda / tensorrt, off for cpu (where numpy
            gathers and scatters the rows without extra session runs). The tokens are the same
            either way. gqa-shared caches are on the device always.
        tf32: let the CUDA EP run float32 matrix products in TF32 (tensor cores, ~10-bit
            mantissa: faster, but a verification block and a decode step can round a near-tie
            differently, so greedy speculation may differ from target-only). Off by default:
            exactness first; fp16 models are not affected.
        split_head: where the exporter split the model's head off its body (manifest `head`),
            run the body and take greedy argmaxes from the int8 shortlist (`runtime/shortlist`)
            and logits from the head alone. Used on the CPU with gqa-shared models on plain
            buffers (elsewhere the whole graph runs); False always runs the whole graph.
    """

    provider: str = "cpu"
    intra_op_threads: int = 0
    allow_spinning: bool = True
    graph_optimization: str = "all"
    device_id: int = 0
    trt_cache_dir: str | None = None
    shared_pool: bool = False
    device_argmax: bool | None = None
    cuda_graph: bool = False
    fixed_buffers: bool = False
    device_kv: bool | None = None
    tf32: bool = False
    split_head: bool = True

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise InputError(
                f"unknown execution provider {self.provider!r}; use one of "
                f"{', '.join(PROVIDERS)}"
            )
        if self.cuda_graph and self.provider != "cuda":
            raise InputError(
                f"cuda_graph needs provider 'cuda' (CUDA graphs are the CUDA execution "
                f"provider's), but this session's provider is {self.provider!r}; drop "
                "cuda_graph or use provider 'cuda'"
            )
        if self.intra_op_threads < 0:
            raise InputError(f"threads must be >= 0, got {self.intra_op_threads}")
        if self.intra_op_threads > max_threads():
            # From a manifest written on a bigger machine, or from an API caller: thousands of
            # threads on a few cores only cost memory and time.
            log.warning("%d intra-op threads asked for, more than %d x the %d cores this "
                        "process may use: using %d", self.intra_op_threads, THREADS_PER_CORE,
                        physical_cores(), max_threads())
            object.__setattr__(self, "intra_op_threads", max_threads())
        if self.graph_optimization not in ("all", "extended", "basic", "disable"):
            raise InputError(f"unknown graph optimization level {self.graph_optimization!r}")

    @property
    def device(self) -> str:
        return "cpu" if self.provider == "cpu" else "cuda"

    @property
    def argmax_on_device(self) -> bool:
        """Whether greedy verification runs the greedy head where the logits are."""
        return self.provider != "cpu" if self.device_argmax is None else self.device_argmax

    @property
    def kv_on_device(self) -> bool:
        """Whether a concat-form model's KV cache lives on its device (`device_kv`)."""
        return self.provider != "cpu" if self.device_kv is None else self.device_kv

    @property
    def fixed(self) -> bool:
        """Whether steps run on fixed preallocated buffers (always with CUDA graphs)."""
        return self.fixed_buffers or self.cuda_graph


def physical_cores() -> int:
    """Cores this process may use (affinity-aware)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


_global_pool_threads: int | None = None


def global_pool_active() -> bool:
    """Whether this process runs ONNX Runtime sessions on the process-wide thread pool (then
    every later session must join it)."""
    return _global_pool_threads is not None


def _ensure_global_pool(threads: int) -> int:
    """Create the process-wide intra-op pool once (later calls reuse it, whatever they ask)."""
    global _global_pool_threads
    if _global_pool_threads is None:
        from onnxruntime.capi import _pybind_state

        _pybind_state.set_global_thread_pool_sizes(threads or physical_cores(), 1)
        _global_pool_threads = threads or physical_cores()
    return _global_pool_threads


def _session_options(config: SessionConfig) -> ort.SessionOptions:
    ort.set_default_logger_severity(_log_severity)
    so = ort.SessionOptions()
    if config.shared_pool or _global_pool_threads is not None:
        # Once the process-wide pool exists ONNX Runtime refuses per-session pools, so every
        # later session joins it (explicit thread counts are then ignored, and logged).
        if not config.shared_pool and config.intra_op_threads:
            log.warning("intra_op_threads=%d ignored: this process already runs ONNX Runtime "
                        "sessions on the shared %d-thread pool", config.intra_op_threads,
                        _global_pool_threads)
        _ensure_global_pool(config.intra_op_threads)
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = config.intra_op_threads
        so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[config.graph_optimization]
    so.add_session_config_entry("session.intra_op.allow_spinning",
                                "1" if config.allow_spinning else "0")
    so.log_severity_level = _log_severity
    return so


def _providers(config: SessionConfig) -> list[Any]:
    available = ort.get_available_providers()
    name = PROVIDERS[config.provider]
    if name not in available:
        raise InputError(
            f"execution provider {config.provider!r} ({name}) is not available in this "
            f"onnxruntime build (available: {', '.join(available)}); install onnxruntime-gpu "
            "for cuda/tensorrt, or use --providers cpu"
        )
    if config.provider == "cpu":
        return ["CPUExecutionProvider"]
    cuda = ("CUDAExecutionProvider", cuda_provider_options(config))
    if config.provider == "cuda":
        return [cuda, "CPUExecutionProvider"]
    trt_opts: dict[str, Any] = {"device_id": config.device_id, "trt_fp16_enable": True}
    if config.trt_cache_dir:
        trt_opts.update(trt_engine_cache_enable=True, trt_engine_cache_path=config.trt_cache_dir,
                        trt_timing_cache_enable=True)
    return [("TensorrtExecutionProvider", trt_opts), cuda, "CPUExecutionProvider"]


def fallback_message(asked: str, ran_on: Sequence[str], what: str, reason: str = ""
                     ) -> tuple[bool, str] | None:
    """What to say when ONNX Runtime started a session for `what` on other providers than
    `asked` (it falls back without an error when a GPU provider's libraries or driver do not
    load): (True, message) when it would run on the CPU instead of the GPU asked for, an error;
    (False, message) when TensorRT fell back to CUDA, a warning; None when the asked provider
    runs. One line each, naming the command that shows what is missing; `reason`, when known,
    is the provider's own first error line."""
    name = PROVIDERS[asked]
    if asked == "cpu" or name in ran_on:
        return None
    why = f" ({reason[:200]})" if reason else ""
    doctor = f"run `specedge doctor --providers {asked}` to see what is missing"
    if asked == "tensorrt" and PROVIDERS["cuda"] in ran_on:
        return False, f"{what}: TensorRT did not start here{why}, so it runs on CUDA; {doctor}"
    return True, (f"{what}: {name} was asked for, but ONNX Runtime could not start it{why} and "
                  f"fell back to {', '.join(ran_on) or 'nothing'}; {doctor} (the NVIDIA driver, "
                  "CUDA or cuDNN libraries), or use --providers cpu")


def cuda_attention_problem(spec: ModelSpec, config: SessionConfig) -> tuple[bool, str] | None:
    """Whether a gqa-shared model of float32 activations can run on `config`'s CUDA provider:
    ONNX Runtime's CUDA GroupQueryAttention takes float16 and bfloat16 only, so its attention
    (and the whole KV cache, every call) would go to the CPU. (True, message): an error (CUDA
    graphs cannot capture a graph split between devices); (False, message): a warning; None:
    fine. One line, naming the export that fixes it."""
    if config.provider != "cuda" or spec.graph != "gqa-shared" or spec.kv.dtype != "float32":
        return None
    fix = ("export it for the GPU (`specedge export ... --provider cuda --precision fp16`, e.g. "
           "models/smollm2-135m-gpu.sh) or run it with --providers cpu")
    if config.cuda_graph:
        return True, (f"{spec.path}: CUDA graphs need every node on the GPU, but this fp32 "
                      "model's GroupQueryAttention has no CUDA kernel (fp16/bf16 only); " + fix)
    return False, (f"{spec.path}: this fp32 model's GroupQueryAttention has no CUDA kernel "
                   "(fp16/bf16 only), so its attention and KV cache cross to the CPU on every "
                   "call (slow); " + fix)


def _first_line(exc: BaseException) -> str:
    """The first line of an ONNX Runtime error, without its C++ source location and function
    signature (`/onnxruntime_src/...cc:729 void f(A&, B&) Please install ...`)."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\S+\.(?:cc|cpp|h):\d+ .*?\) ", "", line)[:300]


def start_session(path: Path, config: SessionConfig, what: str, fix: str) -> ort.InferenceSession:
    """An ONNX Runtime session of the graph at `path` for `what` on `config`'s provider.

    ONNX Runtime's own fallback is off (it prints a banner to stdout and retries on other
    providers); when a GPU provider fails to start, the rest of the provider chain is tried to
    tell a provider that cannot start from a file that cannot load, and `fallback_message`
    decides: a session on the CPU instead of the GPU asked for is an error, TensorRT falling
    back to CUDA a warning.

    Raises:
        InputError: the GPU provider asked for does not start here.
        ModelError: the graph does not load (`fix` says what to do).
    """
    chain = _providers(config)
    options = _session_options(config)
    reason = ""
    try:
        session = ort.InferenceSession(str(path), options, providers=chain, enable_fallback=0)
    except Exception as exc:  # onnxruntime raises its own exception types
        if len(chain) == 1:
            raise ModelError(f"{path}: ONNX Runtime could not load {what} ({_first_line(exc)}); "
                             f"{fix}") from None
        reason = _first_line(exc)
        try:
            session = ort.InferenceSession(str(path), options, providers=chain[1:],
                                           enable_fallback=0)
        except Exception:  # the file itself, then: say what the first try said
            raise ModelError(f"{path}: ONNX Runtime could not load {what} ({reason}); {fix}"
                             ) from None
    said = fallback_message(config.provider, session.get_providers(), what, reason)
    if said is not None and said[0]:
        raise InputError(said[1])
    if said is not None:
        log.warning("%s", said[1])
    return session


def helper_config(config: SessionConfig) -> SessionConfig:
    """The session settings of the small shipped graphs that run beside a model on its device
    (the greedy head, the KV gather / scatter): one thread (or the shared pool), no CUDA graphs
    or fixed buffers, and the CUDA EP where the model runs on TensorRT (their shapes change every
    call, and TensorRT would build an engine for each)."""
    return replace(config, provider="cpu" if config.provider == "cpu" else "cuda",
                   intra_op_threads=0 if global_pool_active() else 1, cuda_graph=False,
                   fixed_buffers=False, device_argmax=False, device_kv=False)


def cuda_provider_options(config: SessionConfig) -> dict[str, str]:
    """The CUDA execution provider's options for `config` (strings, as ONNX Runtime takes)."""
    # ONNX Runtime's CUDA EP defaults use_tf32 to on: float32 products then round their inputs
    # to 10 mantissa bits, and near-ties of fp32 logits flip between call widths.
    options = {"device_id": str(config.device_id), "use_tf32": "1" if config.tf32 else "0"}
    if config.cuda_graph:
        options["enable_cuda_graph"] = "1"
    return options


NO_GRAPH = -1  # gpu_graph_id of a run that is neither captured nor replayed (e.g. a prefill)


def graph_run_options(graph_id: int | None) -> ort.RunOptions | None:
    """Run options that tie a run to CUDA graph `graph_id` (>= 1), or keep it out of graph
    capture (`NO_GRAPH`); None: no CUDA graphs, plain runs.

    ONNX Runtime captures a graph on the first runs with a new id and replays it afterwards;
    id 0 is its own default, so a session with graphs on always says which id a run is.
    """
    if graph_id is None:
        return None
    if graph_id != NO_GRAPH and graph_id < 1:
        raise AssertionError(f"CUDA graph ids start at 1, got {graph_id}")
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


_NO_GRAPH_OPTIONS = graph_run_options(NO_GRAPH)


# ----------------------------------------------------------------------------- model files


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
    dtype = _NP_DTYPES[spec.kv.dtype]
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
        # The token fed at each position (a one-token step of a two-row model re-feeds one).
        self.fed = np.zeros((batch, max_len), dtype=np.int64)
        self.host: np.ndarray | None = None  # the concat form's cache in host memory
        self.values: list[ort.OrtValue] = []
        self.device_kv: DeviceKV | None = None
        self._fixed: FixedBuffers | None = None
        if model.config.fixed if fixed is None else fixed:
            self._fixed = model._take_fixed(batch, max_len)
            self.values = self._fixed.values
        else:
            self._allocate()
        self._binding: Any = None
        self._staging: dict[str, np.ndarray] = {}  # host concat form: reused per-call buffers
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
                shape, _NP_DTYPES[self.model.spec.logits_dtype], cfg.device, cfg.device_id)
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
            buf = self._staging[name] = np.empty(size, _NP_DTYPES[self.model.spec.kv.dtype])
        return buf[:elements]

    def _allocate(self) -> None:
        self.host, self.values, self.device_kv = _allocate_kv(self.model, self.batch,
                                                              self.max_len)

    def __del__(self) -> None:
        fixed = getattr(self, "_fixed", None)
        if fixed is not None:
            self._fixed = None
            self.model._give_back(fixed)

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


_NO_ROWS = np.zeros(0, np.int64)
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
# The most positions (rows x positions) the greedy head takes the argmax of on the device. On
# the H200 it ran in 0.17-0.25 ms for one position but in 5.2-5.6 ms for 2 to 8 (its broadcast
# compare and reductions over several rows; docs/results/gpu_diag.md), while copying a few
# rows of logits to numpy's argmax cost far less (K=3: 171 tok/s with the argmax on the host,
# 130 with the head; docs/results/gpu_h200.md). One-row steps keep the head.
HEAD_MAX_POSITIONS = 1
# Pasts the row probe computes a position after (`OrtModel.probe_rows`), per device: GPU kernels
# change their split of the keys with the past's length (CUDA's did between 34 and 66 on the
# H200); the CPU's one-row difference shows after a short past already, and a long one would add
# ~0.5 s to loading the reference pair on a small CPU.
# (66 and 130: the pasts at which the H200's steps differed, diag `exact`, the same tokens.)
ROW_PROBE_PASTS = {"cpu": (4,), "cuda": (4, 66, 130)}
GRAPH_WARMUP_RUNS = 2  # plain runs of a width before its CUDA graph is captured (ORT's minimum)


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
            (fixed.batch, width, model.logits_size), _NP_DTYPES[spec.logits_dtype], cfg.device,
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
            return _NO_GRAPH_OPTIONS
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
        self.dtype = _NP_DTYPES[logits_dtype]
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


class OrtModel:
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
            self._check_external_data(root, model_file)
        self.split: SplitHead | None = None
        if head is not None:
            self.split = SplitHead(root, head, _session_options(config), _providers(config))
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
                                     "the file may be truncated or corrupt: re-export the pair")
        if problem is not None:  # after the start: where CUDA does not start, that error alone
            log.warning("%s", problem[1])
        if config.fixed and spec.graph != "gqa-shared":
            raise InputError(
                f"{path}: fixed buffers and CUDA graphs need a gqa-shared model (the KV cache "
                f"bound in place), but the manifest says {spec.graph!r}; re-export the pair "
                "without --graph concat, or turn cuda_graph off"
            )
        self.vocab_ids = self._load_vocab_ids(root)
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
        self._check_io()
        self.head = (GreedyHead(config, spec.logits_dtype, self.logits_size)
                     if config.argmax_on_device else None)
        self.calls = 0
        # Run one-token steps as two rows (see `probe_rows`); set by whoever loads the model.
        self.two_row_steps = False
        self.row_probe: RowProbe | None = None

    def _check_external_data(self, root: Path, rel: str) -> None:
        """Refuse a model whose tensors read external data from a file the manifest does not
        list (only listed files are confined and hashed)."""
        path = root / rel
        try:
            locations = external_data_files(path)
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            raise ModelError(
                f"{path}: the {self.name} model is not a valid ONNX file ({exc}); the file may "
                "be truncated or corrupt: re-export the pair"
            ) from None
        folder = os.path.dirname(rel)
        manifest = root / MANIFEST_NAME
        for location in sorted(locations):
            rel = os.path.normpath(os.path.join(folder, location)).replace(os.sep, "/")
            key = f"models.{self.name}.files"
            if os.path.isabs(location) or rel.startswith("../") or rel not in self.spec.files:
                raise ManifestError(
                    f"{path}: the {self.name} model reads external data from {location!r}, "
                    f"which {manifest} does not list under {key}; the runtime opens only "
                    "listed, hashed files: re-export the pair"
                )
            confine(root, rel, file=manifest, key=f"{key}.{rel}")

    def _load_vocab_ids(self, root: Path) -> np.ndarray | None:
        """Token ids the logits cover, for a reduced-vocabulary draft head (None: all)."""
        if self.spec.vocab_ids is None:
            return None
        path = root / self.spec.vocab_ids
        try:
            with open(path, "rb") as fh:  # the header first: the declared shape must fit
                version = np.lib.format.read_magic(fh)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(fh)
                offset = fh.tell()
            count = shape[0] if len(shape) == 1 else -1
            if not 0 < count <= self.spec.vocab_size or dtype.kind not in "iu" or \
                    offset + count * dtype.itemsize != path.stat().st_size:
                raise ValueError(f"its header declares shape {shape} of {dtype}, not up to "
                                 f"{self.spec.vocab_size} token ids filling the file")
            ids = np.load(path, allow_pickle=False)  # never unpickle
        except (OSError, ValueError, TypeError, MemoryError) as exc:
            raise ModelError(f"{path}: unreadable vocabulary subset ({str(exc)[:200]}); "
                             "re-export") from None
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or \
                ids.min() < 0 or ids.max() >= self.spec.vocab_size or \
                (np.diff(ids) <= 0).any():
            raise ModelError(f"{path}: the vocabulary subset must be sorted unique token ids "
                             f"in [0, {self.spec.vocab_size}); re-export the pair")
        return ids.astype(np.int64)

    def _check_io(self) -> None:
        spec = self.spec
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        pasts = [p.format(i=i) for i in range(spec.num_layers)
                 for p in (spec.kv.past_key, spec.kv.past_value)]
        presents = [p.format(i=i) for i in range(spec.num_layers)
                    for p in (spec.kv.present_key, spec.kv.present_value)]
        needed_in = [spec.input_ids, spec.attention_mask, *pasts]
        if spec.position_ids:
            needed_in.append(spec.position_ids)
        needed_out = [self._out[0], *presents]
        missing = [n for n in needed_in if n not in inputs] + [
            n for n in needed_out if n not in outputs]
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more"
                                              if len(missing) > 4 else "")
            raise ModelError(
                f"{self.spec.path}: the {self.name} model lacks the tensors the manifest names "
                f"({shown}); re-export the pair"
            )
        for name in pasts:  # [batch, kv_heads, past, head_dim]: the static dims must agree
            shape = inputs[name].shape
            if len(shape) != 4:
                continue
            for dim, key, want in ((1, "num_kv_heads", spec.num_kv_heads),
                                   (3, "head_dim", spec.head_dim)):
                if isinstance(shape[dim], int) and shape[dim] != want:
                    raise ModelError(
                        f"{self.spec.path}: the {self.name} model's {name} has {shape[dim]} "
                        f"at dimension {dim} but the manifest's {key} is {want}; re-export the "
                        "pair"
                    )
        vocab = (outputs[spec.logits].shape[-1] if self.split is None
                 else self.split.full.get_outputs()[0].shape[-1])
        if not isinstance(vocab, int):
            vocab = self._probe_logits_width()
        expected = spec.vocab_size if self.vocab_ids is None else len(self.vocab_ids)
        if vocab != expected:
            raise ModelError(
                f"{self.spec.path}: the {self.name} model has {vocab} logits but the "
                f"manifest says {expected}; re-export the pair"
            )

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

    def probe_rows(self) -> RowProbe | None:
        """Compute one position alone, as the second row of a two-token block and as the third
        of a three-token one (fresh caches, plain runs, arbitrary tokens) after the pasts of
        `ROW_PROBE_PASTS` (a short one, and on a GPU longer ones), and compare its logits; None
        when the model's context is shorter than five tokens, or when it cannot run them (NaN
        logits, say: its first generation then reports why).

        The long pasts matter on GPUs: on the H200, the CUDA EP's kernels computed a
        one-token step exactly as a block after 6, 18 and 34 past tokens, but not after 66 or 130
        (docs/results/gpu_diag.md), and greedy speculation then differed at fp16 near-ties."""
        spec = self.spec
        if spec.max_seq_len < 5:
            return None
        probes = []
        on, self.two_row_steps = self.two_row_steps, False
        try:
            pasts = ROW_PROBE_PASTS[self.config.device]
            for n in sorted({min(past + 1, spec.max_seq_len) for past in pasts}):
                probes.append(self._probe_at(n))
        except ModelError as exc:
            log.debug("row probe of the %s model skipped: %s", self.name, exc)
            return None
        finally:
            self.two_row_steps = on
        return RowProbe.worst(probes)

    def _probe_at(self, n: int) -> RowProbe:
        """The row probe on `n` arbitrary tokens: the last one alone after n - 1, and as the
        last row of blocks of two and three."""
        spec = self.spec
        ids = (np.arange(n, dtype=np.int64) * 7919 + 11) % spec.vocab_size
        # At least the cache a generation gets (a sliding-window model refuses a shorter one).
        length = min(spec.max_seq_len, max(n, spec.min_cache_len))

        def last(split: int) -> np.ndarray:
            cache = KVCache(self, 1, length, fixed=False)
            self.forward(cache, ids[None, :split])
            return self.forward(cache, ids[None, split:])[0, -1].astype(np.float64)

        alone, two, three = last(n - 1), last(n - 2), last(n - 3)
        return RowProbe(single=float(np.abs(alone - two).max()),
                        block=float(np.abs(two - three).max()),
                        scale=float(np.abs(two).max()))

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

    def forward_rows(self, cache: KVCache, rows: np.ndarray, tokens: np.ndarray,
                     new_lens: np.ndarray) -> np.ndarray:
        """Ragged batch step: row `rows[i]` of `cache` is fed `tokens[i, :new_lens[i]]`.

        Each row keeps its own length. The rows' pasts are padded to the longest with
        attention-mask holes, the new tokens get per-row position ids, and only each row's
        `new_lens[i]` new keys/values are copied back after its own prefix. Rows of the cache
        that are not in `rows` are neither fed nor paid for. Concat-form graphs only (ONNX
        Runtime's GroupQueryAttention, CPU and CUDA, refuses batch > 1 with several new tokens
        after a past). On a GPU provider the cache stays on the device (`runtime/device_kv`).

        Returns:
            logits `[len(rows), tokens.shape[1], vocab]`; entries past `new_lens[i]` are padding.
        """
        logits, valid, skip = self._rows_step(cache, rows, tokens, new_lens)
        out = _host(logits)
        if not math.isfinite(float(out[valid].sum(dtype=np.float64))):
            raise self._not_finite()
        return out[:, skip:] if skip else out

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
        past = int(lengths.max())
        total = past + width  # the padded attention span; only each row's own tokens are kept
        if int((lengths + new_lens).max()) > cache.max_len:
            raise InputError(f"{self.name} model: {int((lengths + new_lens).max())} tokens "
                             f"exceed the context of {cache.max_len}")
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
        out = np.zeros((count, width, self.logits_size), _NP_DTYPES[self.spec.logits_dtype])
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
        out = np.empty((len(rows), self.logits_size), _NP_DTYPES[self.spec.logits_dtype])
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
        dtype = np.dtype(_NP_DTYPES[spec.kv.dtype])
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
            self.session.run_with_iobinding(binding, _NO_GRAPH_OPTIONS if cfg.cuda_graph
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
        """One concat-form run on a cache kept in host memory: the rows' pasts gathered into,
        and the presents written to, staging buffers the cache reuses (bound by address), then
        each row's new positions copied after its own prefix. The logits: a new host array on
        the CPU, left on the device elsewhere.

        Nothing as large as the cache is allocated per call. Fresh past and present arrays for
        every layer and call made glibc map and unmap them: 1,800 page faults per call at batch
        8 once a draft's cache was allocated too, and target calls 13% slower."""
        spec, host, r = self.spec, cache.host, len(rows)
        assert host is not None, "a concat-form cache in host memory"
        n, heads, dim = host.shape[0], spec.num_kv_heads, spec.head_dim
        pasts = cache.staging("pasts", n * r * heads * past * dim).reshape(n, r, heads, past, dim)
        presents = cache.staging("presents", n * r * heads * (past + width) * dim).reshape(
            n, r, heads, past + width, dim)
        for i, row in enumerate(rows):  # one copy per row, all layers at once
            pasts[:, i] = host[:, row, :, :past]
        binding = self.session.io_binding()
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(arr))
        for k, (past_name, present_name) in enumerate(self._kv_names):
            binding.bind_input(past_name, "cpu", 0, host.dtype, pasts[k].shape,
                               pasts[k].ctypes.data)
            binding.bind_output(present_name, "cpu", 0, host.dtype, presents[k].shape,
                                presents[k].ctypes.data)
        host_logits = None
        if self.config.provider == "cpu":
            host_logits = np.empty((r, width, self.logits_size), _NP_DTYPES[spec.logits_dtype])
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

    def _embeddable(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens`, with the ids this model's embedding table lacks replaced by 0: a draft
        padded to fewer rows than its target's vocabulary (`ModelSpec.input_vocab_size`) is
        fed the target's tokens, which may lie past its table. Only its guesses depend on what
        it is fed; the target checks every one."""
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
        options = _NO_GRAPH_OPTIONS if self.config.cuda_graph else None
        if self.config.provider == "cpu" and not self.config.argmax_on_device:
            # Write the logits into a host buffer kept per shape: no per-call allocation, and no
            # Python wrappers for the 2 * layers present outputs (get_outputs would build them).
            # (The hidden state instead, for a body whose head is split off.)
            name, size = self._out
            shape = (tokens.shape[0], width, size or self.logits_size)
            buf = cache._logits.get(shape)
            if buf is None:
                buf = cache._logits[shape] = np.empty(shape, dtype=_NP_DTYPES[
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
