"""Validate an exported model (and a pair's two, `validate_pair`) against torch: a prefill, then a
multi-token step with a past.

The ONNX side runs through the runtime's own backend (IO binding, shared KV buffers), so what is
validated is exactly what `generate` will run. Reports max |Δlogits|, top-1 agreement and the mean
KL(torch ‖ onnx) over the step positions. fp32 and fp16 exports fail loudly past their tolerance;
quantized exports are judged by top-1 agreement and KL, not by atol. fp16's tolerance grows with
the logits' magnitude: an fp16 logit near 32 is stored to 1/32, so a fixed 0.05 would fail a
correct export (SmolLM2-135M fp16 differs from torch fp32 by 0.078 with every top-1 equal).
The result records which execution provider the comparison ran on: the export's own provider
when it can run here, else the CPU provider (an fp16 or int4 CUDA graph runs there too, through
its CPU kernels), with the reason (`validation_provider`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specedge.runtime.backend import OrtModel
from specedge.runtime.errors import ExportError, InputError
from specedge.runtime.manifest import ModelSpec
from specedge.runtime.sessions import SessionConfig

from .checkpoint import load_complete

if TYPE_CHECKING:
    from .vocab_bridge import VocabBridge

TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}
FP16_RELATIVE = 1e-2  # fp16: max |Δ| may reach 1% of the largest |logit| (about 10 fp16 steps)
PREFILL, STEP = 12, 5
TORCH_REFERENCE = "torch fp32 (transformers, eager attention)"
# A self-draft beside a target copied from a pair (`target_reuse`) is compared with that target.
COPIED_REFERENCE = "the pair's fp32 target (ONNX Runtime, CPU; itself validated against torch)"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """max |Δ|, top-1 agreement and mean KL(reference ‖ candidate) over `[positions, vocab]`."""
    ref_lp, cand_lp = _log_softmax(reference), _log_softmax(candidate)
    kl = (np.exp(ref_lp) * (ref_lp - cand_lp)).sum(-1)
    return {
        "max_abs_diff": float(np.abs(reference - candidate).max()),
        "top1_agreement": float((reference.argmax(-1) == candidate.argmax(-1)).mean()),
        "kl_mean": float(kl.mean()),
    }


def torch_logits(hf_dir: Path, ids: np.ndarray) -> np.ndarray:
    """Logits of the HF model on `ids` `[1, n]` → `[n, vocab]` (fp32, eager attention)."""
    import torch

    model = load_complete(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids))
    return out.logits[0].float().numpy()


def tolerance(precision: str, reference: np.ndarray) -> float | None:
    """The max |Δlogits| allowed for an export of `precision` (None: judged by top-1 and KL)."""
    tol = TOLERANCE.get(precision)
    if precision == "fp16" and tol is not None:
        return max(tol, FP16_RELATIVE * float(np.abs(reference).max()))
    return tol


def validation_provider(requested: str) -> tuple[str, str | None]:
    """The provider to validate a `requested` export on, and why it is another (None if not):
    a CUDA export is validated on CUDA when this onnxruntime build has the CUDA provider and
    the driver sees a GPU, else on the CPU."""
    if requested == "cpu":
        return "cpu", None
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "cpu", "this onnxruntime build has no CUDA provider"
    from specedge.runtime.doctor import gpus_from_libcuda

    gpus, _ = gpus_from_libcuda()
    if not gpus:
        return "cpu", "no GPU found"
    return requested, None


def validate_model(root: Path, spec: ModelSpec, name: str, reference: np.ndarray,
                   ids: np.ndarray, provider: str = "cpu",
                   reference_name: str = TORCH_REFERENCE) -> dict[str, Any]:
    """Run the exported model through the runtime backend and compare with torch's logits.

    Args:
        root: pair folder (possibly the temporary one being written).
        spec: the model's manifest entry.
        name: "target" or "draft".
        reference: torch logits `[PREFILL + STEP, vocab]` of the unquantized source model.
        ids: the token ids `[1, PREFILL + STEP]` they were computed on.
        provider: the provider the export is for ("cpu" or "cuda"); validated on it when it
            can run here, else on the CPU (`validation_provider`; the result says which).
        reference_name: what `reference` came from, for the record.

    Raises:
        ExportError: an fp32/fp16 export is past its tolerance.
    """
    used, why = validation_provider(provider)
    try:
        model = OrtModel(root, spec, name, SessionConfig(provider=used))
    except InputError as exc:  # the GPU is there, but its provider did not start
        if used == "cpu":
            raise
        used, why = "cpu", f"ONNX Runtime could not start it here ({exc})"
        model = OrtModel(root, spec, name, SessionConfig(provider=used))
    prefill, step = _prefill_and_step(model, ids)
    # Batch 2: the same rows twice must give the same logits as batch 1.
    cache2 = model.new_cache(2, 64)
    both = model.forward(cache2, np.repeat(ids, 2, axis=0))
    result: dict[str, Any] = {
        "prefill": compare(reference[:PREFILL], prefill),
        "step_with_past": compare(reference[PREFILL:], step),
        "batch2_max_abs_diff": float(np.abs(both[1] - both[0]).max()),
        "prefill_tokens": PREFILL,
        "step_tokens": STEP,
        "reference": reference_name,
        "provider": model.session.get_providers()[0],
        "requested_provider": provider,
    }
    if why is not None:
        result["note"] = f"validated on CPU, not {provider}: {why}"
    tol = tolerance(spec.precision, reference)
    worst = max(result["prefill"]["max_abs_diff"], result["step_with_past"]["max_abs_diff"])
    result["tolerance"] = tol
    result["passed"] = bool(tol is None or worst <= tol)
    if tol is not None and not result["passed"]:
        raise ExportError(
            f"{root / spec.path}: {name} ({spec.precision}) differs from torch by max |Δlogits| "
            f"{worst:.3g} > {tol:g} on {result['provider']} (prefill {result['prefill']}, step "
            f"{result['step_with_past']}); the export is wrong, please report it"
        )
    return result


def _prefill_and_step(model: OrtModel, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The logits of a prefill of `ids[:, :PREFILL]`, then of a step of the rest with that
    past: `[PREFILL, vocab]`, `[STEP, vocab]`."""
    cache = model.new_cache(1, 64)
    return model.forward(cache, ids[:, :PREFILL])[0], model.forward(cache, ids[:, PREFILL:])[0]


def onnx_logits(root: Path, spec: ModelSpec, name: str, ids: np.ndarray) -> np.ndarray:
    """An exported model's logits on `ids` `[1, n]` → `[n, vocab]`, as `validate_model` runs it
    (on the CPU)."""
    return np.concatenate(_prefill_and_step(OrtModel(root, spec, name, SessionConfig()), ids))


def validation_ids(vocab_size: int, text_ids: list[int] | None, seed: int = 0) -> np.ndarray:
    """Token ids `[1, PREFILL + STEP]`: real text when available, padded with seeded ids."""
    rng = np.random.default_rng(seed)
    ids = list(text_ids or [])[: PREFILL + STEP]
    ids += list(rng.integers(3, vocab_size, PREFILL + STEP - len(ids)))
    return np.asarray([ids], dtype=np.int64)


def validate_pair(tmp: Path, target: ModelSpec, draft: ModelSpec | None, target_folder: Path,
                  draft_folder: Path | None, provider: str, bridge: VocabBridge | None = None,
                  validate_target: bool = True) -> tuple[ModelSpec, ModelSpec | None]:
    """Compare both models of the pair staged in `tmp` with torch (their HF folders) on the
    export's provider (on CPU when it cannot run here, which the result says); returns their
    specs with the results. A bridged draft (`bridge`) is compared on the ids it is fed and the
    columns it keeps; a reused target (`validate_target` False) keeps its record, and a
    self-draft beside a copied fp32 target is compared with it (`COPIED_REFERENCE`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_folder / "tokenizer.json"))
    text = tok.encode("Speculative decoding makes edge devices fast, and exact too.").ids
    # ids every model embeds (a padded draft's table may be the smaller)
    ids = validation_ids(min(spec.input_vocab_size or spec.vocab_size
                             for spec in (target, draft) if spec is not None
                             and spec.input_id_map is None), text)
    self_draft = draft_folder == target_folder
    ref, ref_name = None, TORCH_REFERENCE
    if validate_target or (self_draft and target.precision != "fp32"):
        ref = torch_logits(target_folder, ids)
    elif self_draft and draft is not None:  # a copied fp32 target: its weights may be absent
        ref, ref_name = onnx_logits(tmp, target, "target", ids), COPIED_REFERENCE
    if ref is not None and validate_target:
        target = dataclasses.replace(target, validation=validate_model(
            tmp, target, "target", ref, ids, provider=provider))
    if draft is not None and draft_folder is not None:
        if bridge is not None:
            dref = torch_logits(draft_folder, bridge.input_map[ids])[:, bridge.columns]
        elif self_draft and ref is not None:
            dref = ref
        else:
            dref = torch_logits(draft_folder, ids)
        draft = dataclasses.replace(draft, validation=validate_model(
            tmp, draft, "draft", dref, ids, provider=provider, reference_name=ref_name))
    return target, draft
