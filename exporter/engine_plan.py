"""What `specedge build-engine` builds, and whether it can here: the graph forms TensorRT takes
whole, one optimization profile per model from its ONNX inputs and the manifest, the TensorRT EP
options that build it and dump it as an EPContext model, and one line saying what to install where
TensorRT cannot run. Pure functions (but `require_tensorrt`, which asks ONNX Runtime and the GPU);
`engine` builds with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specedge.runtime.engines import (
    TENSORRT_EP,
    EngineKey,
    EngineProfile,
    machine_key,
    profile_option,
)
from specedge.runtime.errors import ExportError
from specedge.runtime.manifest import ModelSpec
from specedge.runtime.onnx_file import Dims, GraphSummary, contrib_ops

FLOAT_PRECISIONS = ("fp32", "fp16", "bf16")


def check_graph_form(spec: ModelSpec, name: str, graph: GraphSummary) -> None:
    """Refuse a model TensorRT cannot take whole.

    Raises:
        ExportError: the model is gqa-shared, has ONNX Runtime contrib ops (named, counted) or
            integer weights.
    """
    ops = contrib_ops(graph)
    fix = ("for TensorRT export the pair with --graph concat-standard and fp32 models "
           "(--precision fp32 --draft DRAFT --draft-precision fp32); build-engine --fp16 runs "
           "them in FP16")
    if spec.graph != "concat" or ops:
        shown = ", ".join(f"{op} x{n}" for op, n in ops.most_common(4)) or "none"
        raise ExportError(
            f"{spec.path}: the {name} model is {spec.graph} with ONNX Runtime contrib ops "
            f"({shown}) that TensorRT does not implement; {fix}")
    if spec.precision not in FLOAT_PRECISIONS:
        raise ExportError(
            f"{spec.path}: the {name} model is {spec.precision}, quantized with ONNX Runtime's "
            f"integer ops (MatMulInteger / DynamicQuantizeLinear) that TensorRT does not take; "
            f"{fix}")


# ----------------------------------------------------------------------------- profile


def profile_shapes(spec: ModelSpec, inputs: Sequence[tuple[str, Dims]], *, batch: int, k: int
                   ) -> EngineProfile:
    """The optimization profile of one model, from its ONNX inputs and the manifest.

    Args:
        spec: the model's manifest entry (input names, KV names, heads, head size, max length).
        inputs: the graph's inputs as (name, dims); ints are static, str/None are dynamic.
        batch: the largest batch (B).
        k: the largest draft length (K): verification feeds K+1 tokens.

    Returns:
        min / opt / max of every input with a dynamic dimension (static inputs are left out).

    Raises:
        ExportError: an input the manifest does not name, or an unexpected rank.
    """
    n = spec.max_seq_len
    past_opt = max(0, min(n - k - 1, n // 2))
    # role -> (min, opt, max) of each dimension; None keeps the graph's static value
    tokens = ((1, batch, batch), (1, k + 1, n))
    roles: dict[str, tuple[tuple[int, int, int], ...]] = {
        spec.input_ids: tokens,
        spec.attention_mask: ((1, batch, batch), (1, past_opt + k + 1, n + k + 1)),
    }
    if spec.position_ids:
        roles[spec.position_ids] = tokens
    kv = ((1, batch, batch), (spec.num_kv_heads,) * 3, (0, past_opt, n - 1), (spec.head_dim,) * 3)
    for i in range(spec.num_layers):
        for pattern in (spec.kv.past_key, spec.kv.past_value):
            roles[pattern.format(i=i)] = kv
    low: dict[str, tuple[int, ...]] = {}
    opt: dict[str, tuple[int, ...]] = {}
    high: dict[str, tuple[int, ...]] = {}
    for name, dims in inputs:
        if all(isinstance(d, int) for d in dims):
            continue
        role = roles.get(name)
        if role is None or len(role) != len(dims):
            raise ExportError(
                f"{spec.path}: input {name!r} {list(dims)} has a dynamic dimension the manifest "
                "does not describe (expected its input_ids, attention_mask, position_ids and "
                "KV inputs); re-export the pair")
        ranges = [(d, d, d) if isinstance(d, int) else r for d, r in zip(dims, role, strict=True)]
        low[name] = tuple(r[0] for r in ranges)
        opt[name] = tuple(r[1] for r in ranges)
        high[name] = tuple(r[2] for r in ranges)
    return EngineProfile(low, opt, high)


def provider_options(profile: EngineProfile, precision: str, folder: Path, *,
                     device_id: int = 0) -> dict[str, Any]:
    """The TensorRT EP options that build one engine with `profile` and dump it as an
    EPContext model with the engine in a file beside it, both in `folder`."""
    return {
        "device_id": device_id,
        "trt_fp16_enable": precision in ("fp16", "int8"),
        "trt_int8_enable": precision == "int8",
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(folder),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(folder),
        "trt_dump_ep_context_model": True,
        "trt_ep_context_file_path": str(folder),
        "trt_ep_context_embed_mode": 0,  # the engine in its own file, named by a relative path
        "trt_profile_min_shapes": profile_option(profile.min),
        "trt_profile_opt_shapes": profile_option(profile.opt),
        "trt_profile_max_shapes": profile_option(profile.max),
    }


# ----------------------------------------------------------------------------- availability


def unavailable_message(available: Sequence[str], reason: str | None, jetson: bool) -> str:
    """One line saying why TensorRT cannot build here and what to install."""
    if TENSORRT_EP not in available:
        wheel = ("the JetPack build of onnxruntime-gpu (pip uninstall -y onnxruntime && pip "
                 "install onnxruntime-gpu --index-url https://pypi.jetson-ai-lab.io/jp6/cu126; "
                 "TensorRT comes with JetPack)" if jetson else
                 'onnxruntime-gpu with TensorRT (pip uninstall -y onnxruntime && pip install '
                 '"onnxruntime-gpu[cuda,cudnn]" tensorrt-cu13-libs)')
        return (f"build-engine needs ONNX Runtime's TensorRT execution provider, which this "
                f"onnxruntime does not have (providers: {', '.join(available)}); install "
                f"{wheel}, then check with `specedge doctor --providers tensorrt`")
    fix = ("sudo apt install nvidia-jetpack" if jetson else
           "pip install tensorrt-cu13-libs, and run on a machine with an NVIDIA GPU")
    return (f"build-engine cannot run TensorRT here: {reason}; {fix}, then check with "
            "`specedge doctor --providers tensorrt`")


def require_tensorrt(device_id: int = 0) -> EngineKey:
    """This machine's key, when TensorRT can build here.

    Raises:
        ExportError: one line saying what to install.
    """
    import onnxruntime as ort

    available = ort.get_available_providers()
    here, reason = machine_key(device_id)
    if TENSORRT_EP in available and here is not None:
        return here
    jetson = Path("/etc/nv_tegra_release").is_file()
    raise ExportError(unavailable_message(available, reason, jetson))
