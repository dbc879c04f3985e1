"""Loading a pair's models: the thread plan of its two sessions, and each model's file (its
ONNX graph, or a TensorRT engine built for this machine).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .backend import OrtModel
from .engines import EngineChoice, choose_engine, machine_key
from .errors import InputError, ModelError
from .manifest import ModelSpec, PairManifest, engine_files_ready
from .sessions import SessionConfig, global_pool_supported, physical_cores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThreadPlan:
    """Per-model ONNX Runtime thread settings (see `plan_threads`)."""

    target: SessionConfig
    draft: SessionConfig


def plan_threads(target_provider: str = "cpu", draft_provider: str = "cpu",
                 target_threads: int = 0, draft_threads: int = 0,
                 cores: int | None = None) -> ThreadPlan:
    """Thread settings that keep two models from fighting over the same cores.

    The draft and the target run one after the other, never together. Two sessions with their
    own spinning pools fight (two spinning 2-thread sessions on 2 cores made speculative
    decoding 0.6x of target only); so by default both CPU models share ONNX Runtime's global
    thread pool (all cores, spinning). With explicit thread counts, or an onnxruntime older
    than 1.23 (which cannot make that pool from Python), each session gets its own pool and
    only the target spins. A model on a GPU gets one host thread.
    """
    cores = cores or physical_cores()

    def one(provider: str, threads: int, spin: bool, default: int) -> SessionConfig:
        if provider != "cpu":
            return SessionConfig(provider=provider, intra_op_threads=threads or 1)
        return SessionConfig(provider="cpu", intra_op_threads=threads or default,
                             allow_spinning=spin)

    if target_provider == draft_provider == "cpu" and not (target_threads or draft_threads) \
            and global_pool_supported():
        # Measured on 2 cores (docs/results/thread_plan.md): one process-wide pool of `cores`
        # spinning threads shared by both sessions beat every per-session split, because the
        # draft and the target take turns and each gets every core with no wake-up latency.
        shared = SessionConfig(provider="cpu", intra_op_threads=cores, allow_spinning=True,
                               shared_pool=True)
        return ThreadPlan(shared, shared)
    # Explicit thread counts or a GPU model: per-session pools. The target spins on all cores;
    # a CPU draft next to a CPU target uses cores - 1 threads and never spins, so it does not
    # busy-wait on the cores the target is about to use.
    shared_cpu = target_provider == draft_provider == "cpu"
    draft_default = max(1, cores - 1) if shared_cpu else cores
    return ThreadPlan(one(target_provider, target_threads, True, cores),
                      one(draft_provider, draft_threads, not shared_cpu, draft_default))


def session_plan(manifest: PairManifest, providers: str | Sequence[str], plan: ThreadPlan | None,
                 *, cuda_graph: bool = False, device_argmax: bool | None = None,
                 split_head: bool = True) -> ThreadPlan:
    """The two models' session settings for `Pair.load`: `plan` (or `plan_threads` for the
    providers and the pair's thread defaults), with the CUDA-graph, device-argmax and split-head
    choices applied.

    Raises:
        InputError: providers that are not one name or (target, draft), or CUDA graphs asked
            for where no gqa-shared model runs on cuda.
    """
    if isinstance(providers, str):
        target_p = draft_p = providers
    else:
        if not isinstance(providers, Sequence) or len(providers) != 2:
            raise InputError("providers must be one name or (target, draft)")
        target_p, draft_p = providers
    d = manifest.defaults
    plan = plan or plan_threads(target_p, draft_p, d.target_threads, d.draft_threads)
    if cuda_graph and "cuda" not in (plan.target.provider, plan.draft.provider):
        raise InputError("CUDA graphs need a model on the cuda provider; use --providers "
                         "cuda (or cuda,cpu), or drop --cuda-graph")
    # CUDA graphs replay the in-place (gqa-shared) steps: a concat-form target keeps
    # plain runs beside a gqa-shared draft that replays its own.
    graphed = {name: cuda_graph and spec is not None and spec.graph == "gqa-shared"
               for name, spec in (("target", manifest.target), ("draft", manifest.draft))}
    if cuda_graph and not any(graphed.values()):
        raise InputError("--cuda-graph replays gqa-shared models, and this pair has none; "
                         "re-export it without --graph concat (or with --draft-graph "
                         "gqa-shared), or drop --cuda-graph")
    if cuda_graph or device_argmax is not None or not split_head:
        def tuned(c: SessionConfig, name: str) -> SessionConfig:
            argmax = c.device_argmax if device_argmax is None else device_argmax
            return replace(c, device_argmax=argmax, split_head=split_head,
                           cuda_graph=c.cuda_graph or (graphed[name] and c.provider == "cuda"))
        plan = ThreadPlan(tuned(plan.target, "target"), tuned(plan.draft, "draft"))
    return plan


def engine_choice(manifest: PairManifest, name: str, config: SessionConfig, *,
                  verify_hashes: bool = True) -> EngineChoice:
    """Whether model `name` loads its prebuilt TensorRT engine (see `engines.choose_engine`),
    with its files checked.

    Raises:
        ManifestError: an engine file whose sha256 differs from the manifest.
    """
    import onnxruntime as ort

    engine = manifest.engines.get(name)
    spec = manifest.target if name == "target" else manifest.draft
    if config.provider != "tensorrt" or spec is None:
        return EngineChoice(None)
    here, why = machine_key(config.device_id) if engine is not None else (None, None)
    choice = choose_engine(name, engine, config.provider, ort.get_available_providers(), here,
                           why, model_sha=spec.files.get(spec.path))
    if choice.engine is not None:
        missing = engine_files_ready(manifest, name, verify_hashes=verify_hashes)
        if missing is not None:
            return EngineChoice(None, f"{name} model: TensorRT engine not used ({missing}); "
                                      f"running {spec.path} instead")
    return choice


def load_model(manifest: PairManifest, name: str, config: SessionConfig, *,
               verify_hashes: bool = True) -> tuple[OrtModel, str | None]:
    """Open model `name` ("target" or "draft") of a pair: its EPContext engine when the
    provider is TensorRT and the engine was built for this machine, else its ONNX file.

    Returns:
        the model and, when an engine was listed or expected but not used, the one-line reason
        (also logged as a warning).

    Raises:
        ManifestError, ModelError, InputError: as `OrtModel`.
    """
    spec = manifest.target if name == "target" else manifest.draft
    assert spec is not None
    choice = engine_choice(manifest, name, config, verify_hashes=verify_hashes)
    model: OrtModel | None = None
    message = choice.message
    if choice.engine is not None:
        # The EPContext model has the ONNX model's inputs and outputs: only the file changes.
        engine_spec: ModelSpec = dataclasses.replace(spec, path=choice.engine.path,
                                                     files=dict(choice.engine.files), head=None)
        try:
            model = OrtModel(manifest.root, engine_spec, name, config)
        except ModelError as exc:  # e.g. TensorRT refuses to deserialize the engine
            message = (f"{name} model: TensorRT engine {choice.engine.path} failed to load "
                       f"({str(exc).split(': ', 1)[-1][:200]}); running {spec.path} instead")
    if model is None:
        model = OrtModel(manifest.root, spec, name, config)
    if message:
        log.warning("%s", message)
    return model, message
