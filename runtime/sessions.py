"""ONNX Runtime sessions: how one model's session is configured and started.

`SessionConfig` (frozen) says it: the execution provider, threads, spinning, the shared
process-wide thread pool, CUDA graphs, fixed buffers, the greedy head on the device, TF32. From it
come ONNX Runtime's session options and provider chain, the CUDA EP's options, and the run
options that tie a run to a CUDA graph. `start_session` starts a session and turns ONNX Runtime's
silent provider fallback into one clear line (an error when a GPU asked for would run on the CPU).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .errors import InputError, ModelError
from .manifest import ModelSpec
from .providers import PROVIDERS, onnxruntime_too_old

NP_DTYPES: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16}
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


def global_pool_supported() -> bool:
    """Whether this onnxruntime can create the process-wide thread pool from Python (its
    `set_global_thread_pool_sizes` came in 1.23; Jetson wheels and Python 3.10 installs are
    often older)."""
    from onnxruntime.capi import _pybind_state

    return hasattr(_pybind_state, "set_global_thread_pool_sizes")


def _ensure_global_pool(threads: int) -> int:
    """Create the process-wide intra-op pool once (later calls reuse it, whatever they ask).

    Raises:
        InputError: this onnxruntime cannot make one (`global_pool_supported`)."""
    global _global_pool_threads
    if _global_pool_threads is None:
        from onnxruntime.capi import _pybind_state

        if not global_pool_supported():
            raise InputError(
                f"the shared thread pool needs onnxruntime >= 1.23 (this is {ort.__version__}); "
                "upgrade onnxruntime, or give each session its own threads (shared_pool=False)")
        _pybind_state.set_global_thread_pool_sizes(threads or physical_cores(), 1)
        _global_pool_threads = threads or physical_cores()
    return _global_pool_threads


def session_options(config: SessionConfig) -> ort.SessionOptions:
    """ONNX Runtime's session options for `config`: its thread pool (per session or the shared
    one), sequential execution, the optimization level, spinning and the log level."""
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


def provider_chain(config: SessionConfig) -> list[Any]:
    """The execution providers to start a session on, best first, with their options.

    Raises:
        InputError: this onnxruntime build lacks the provider asked for.
    """
    available = ort.get_available_providers()
    name = PROVIDERS[config.provider]
    if name not in available:
        raise InputError(
            f"execution provider {config.provider!r} ({name}) is not available in this "
            f"onnxruntime build (available: {', '.join(available)}); install onnxruntime-gpu "
            "for cuda/tensorrt, or use --providers cpu"
        )
    if config.provider == "cpu":
        return [PROVIDERS["cpu"]]
    cuda = (PROVIDERS["cuda"], cuda_provider_options(config))
    if config.provider == "cuda":
        return [cuda, PROVIDERS["cpu"]]
    trt_opts: dict[str, Any] = {"device_id": config.device_id, "trt_fp16_enable": True}
    if config.trt_cache_dir:
        trt_opts.update(trt_engine_cache_enable=True, trt_engine_cache_path=config.trt_cache_dir,
                        trt_timing_cache_enable=True)
    return [(PROVIDERS["tensorrt"], trt_opts), cuda, PROVIDERS["cpu"]]


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


def start_session(path: Path, config: SessionConfig, what: str, fix: str,
                  skip: Sequence[str] = ()) -> ort.InferenceSession:
    """An ONNX Runtime session of the graph at `path` for `what` on `config`'s provider, without
    the graph optimizers named in `skip` (`providers.fusions_to_skip`).

    ONNX Runtime's own fallback is off (it prints a banner to stdout and retries on other
    providers); when a GPU provider fails to start, the rest of the provider chain is tried to
    tell a provider that cannot start from a file that cannot load, and `fallback_message`
    decides: a session on the CPU instead of the GPU asked for is an error, TensorRT falling
    back to CUDA a warning.

    Raises:
        InputError: the GPU provider asked for does not start here.
        ModelError: the graph does not load (`fix` says what to do).
    """
    chain = provider_chain(config)
    options = session_options(config)
    fix = onnxruntime_too_old(ort.__version__) or fix  # the likelier cause, then
    reason = ""
    extra: dict[str, Any] = {"disabled_optimizers": list(skip)} if skip else {}
    try:
        session = ort.InferenceSession(str(path), options, providers=chain, enable_fallback=0,
                                       **extra)
    except Exception as exc:  # onnxruntime raises its own exception types
        if len(chain) == 1:
            raise ModelError(f"{path}: ONNX Runtime could not load {what} ({_first_line(exc)}); "
                             f"{fix}") from None
        reason = _first_line(exc)
        try:
            session = ort.InferenceSession(str(path), options, providers=chain[1:],
                                           enable_fallback=0, **extra)
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


NO_GRAPH_OPTIONS = graph_run_options(NO_GRAPH)  # a run kept out of graph capture
