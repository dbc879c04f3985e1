"""Load a Hugging Face checkpoint, refusing one that lacks weights its model needs.

transformers fills a weight the checkpoint lacks (or has in another shape) with random values
and only warns. An export from such a model would be random where the weight is missing:
validation then reports "differs from torch" for a reason no re-export fixes, and with
`--no-validate` nothing would notice at all. Every place the exporter loads a model from a
folder goes through here: validation (`validate.torch_logits`), the torch export of the concat
form, and ONNX Runtime GenAI's builder in its child process (`builder_shim`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specedge.runtime.errors import ExportError

__all__ = ["check_loading_info", "load_complete"]


def check_loading_info(source: Path | str, info: Mapping[str, Any]) -> None:
    """Raise when `info` (from `from_pretrained(..., output_loading_info=True)`) reports weights
    the checkpoint lacks or holds in another shape.

    Raises:
        ExportError: naming the first few such weights.
    """
    missing = sorted(str(k) for k in info.get("missing_keys") or []) + sorted(
        str(m[0]) if isinstance(m, tuple | list) else str(m)
        for m in info.get("mismatched_keys") or [])
    if missing:
        raise ExportError(f"{source}: the checkpoint lacks {len(missing)} weight(s) the model "
                          f"needs, or has them in another shape ({', '.join(missing[:3])}); it "
                          "is incomplete, corrupt or of another architecture")


def load_complete(hf_dir: Path, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)`, checked by
    `check_loading_info`.

    Raises:
        ExportError: the checkpoint lacks weights.
    """
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True,
                                                       **kwargs)
    model, info = loaded
    check_loading_info(hf_dir, info)
    return model
