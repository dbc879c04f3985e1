"""Run ONNX Runtime GenAI's model builder with the config fixes it needs (a child process).

`python -m specedge.exporter.builder_shim BUILDER-ARGS...` runs
`onnxruntime_genai.models.builder` as its own `__main__` would, after one change: configs that
transformers 5 loads in a shape the builder does not read are rewritten by `fix_config` first.

- gemma3_text: transformers 5 nests the rotary settings per layer kind (`rope_parameters =
  {"full_attention": {...}, "sliding_attention": {...}}`), while the builder's Gemma 3 path
  reads the flat `rope_parameters["rope_type"]`, `rope_theta` and `rope_local_base_freq`, and
  fails. Both kinds with default rotary flatten losslessly; any other scaling is left alone
  (the builder then fails, and `archs.builder_can_take` keeps such a model in the concat form).
"""

from __future__ import annotations

import runpy
import sys
from typing import Any


def nested_rope(config: Any) -> dict[str, dict[str, Any]] | None:
    """The per-layer-kind rotary settings of a gemma3_text config, or None when flat."""
    rp = getattr(config, "rope_parameters", None)
    if getattr(config, "model_type", None) != "gemma3_text" or not isinstance(rp, dict):
        return None
    if not isinstance(rp.get("full_attention"), dict):
        return None
    return rp


def flattenable(config: Any) -> bool:
    """Whether `fix_config` can give the builder this config losslessly (default rotary for both
    layer kinds, or a config the builder reads as it is)."""
    rp = nested_rope(config)
    if rp is None:
        return True
    kinds = [rp["full_attention"], rp.get("sliding_attention", rp["full_attention"])]
    return all(k.get("rope_type", "default") == "default" and "rope_theta" in k for k in kinds)


def fix_config(config: Any) -> Any:
    """Rewrite a nested gemma3_text rotary config into the flat fields the builder reads."""
    rp = nested_rope(config)
    if rp is None or not flattenable(config):
        return config
    full = rp["full_attention"]
    local = rp.get("sliding_attention", full)
    config.rope_theta = full["rope_theta"]
    config.rope_local_base_freq = local["rope_theta"]
    config.rope_parameters = {"rope_type": "default", "rope_theta": full["rope_theta"]}
    return config


def main(argv: list[str]) -> None:
    from transformers import AutoConfig

    load = AutoConfig.from_pretrained

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        return fix_config(load(*args, **kwargs))

    AutoConfig.from_pretrained = from_pretrained  # type: ignore[method-assign]
    sys.argv = ["onnxruntime_genai.models.builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
