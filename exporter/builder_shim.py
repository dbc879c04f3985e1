"""Run ONNX Runtime GenAI's model builder with the config fixes it needs (a child process).

`python -m specedge.exporter.builder_shim BUILDER-ARGS...` runs
`onnxruntime_genai.models.builder` as its own `__main__` would, after two changes:

- configs that transformers 5 loads in a shape the builder does not read are rewritten by
  `fix_config` first;
- a checkpoint that lacks weights its model needs is refused (`checkpoint.check_loading_info`)
  instead of built with the random values transformers fills in: the child prints one
  `ERROR_PREFIX` line and exits with `ERROR_EXIT`, and `onnx_export.build_gqa` raises that line.
  Without this, `export --no-validate` wrote such a model without a word.

- gemma3_text: transformers 5 nests the rotary settings per layer kind (`rope_parameters =
  {"full_attention": {...}, "sliding_attention": {...}}`), while the builder's Gemma 3 path
  reads the flat `rope_parameters["rope_type"]`, `rope_theta` and `rope_local_base_freq`, and
  fails. Both kinds with default rotary flatten losslessly; any other scaling is left alone
  (the builder then fails, and `archs.builder_can_take` keeps such a model in the concat form).
- smollm3: the builder (0.18) marks a NoPE layer (`no_rope_layers[i] == 0`) as one whose rotary
  runs outside attention, which needs the `position_ids` input that fused rotary removed (a
  KeyError) and would rotate a layer that takes no rotary at all. `fix_smollm3` builds such a
  layer with no rotary (GroupQueryAttention's `do_rotary=0`); validation against torch checks it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

ERROR_PREFIX = "specedge-error: "
ERROR_EXIT = 3


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


def install_checks() -> None:
    """Patch transformers in this (the builder's child) process: configs pass through
    `fix_config`, and every model class's `from_pretrained` refuses a checkpoint that lacks
    weights (`checkpoint.check_loading_info`: `ExportError`)."""
    from transformers import AutoConfig, PreTrainedModel

    from .checkpoint import check_loading_info

    load_config = AutoConfig.from_pretrained
    load_model = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def config_from_pretrained(*args: Any, **kwargs: Any) -> Any:
        return fix_config(load_config(*args, **kwargs))

    def model_from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        # Every model class's loader, whichever the builder picks (AutoModelForCausalLM ends here).
        wanted = kwargs.pop("output_loading_info", False)
        model, info = load_model(cls, *args, output_loading_info=True, **kwargs)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        check_loading_info(source if isinstance(source, str | Path) else cls.__name__, info)
        return (model, info) if wanted else model

    AutoConfig.from_pretrained = config_from_pretrained  # type: ignore[method-assign]
    PreTrainedModel.from_pretrained = classmethod(model_from_pretrained)  # type: ignore[assignment]


def fix_smollm3() -> None:
    """Build SmolLM3's NoPE layers without rotary (see the module docstring)."""
    import onnxruntime_genai.models  # noqa: F401  (puts the builder's `builders` on sys.path)
    from builders.smollm import SmolLM3Model  # type: ignore[import-not-found]

    build = SmolLM3Model.make_attention

    def make_attention(self: Any, layer_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.no_rope_layers[layer_id]:
            return build(self, layer_id, *args, **kwargs)
        attrs = self.attention_attrs
        saved = attrs["rope"], attrs["use_rope_in_attn"]
        attrs["rope"] = False
        try:  # the builder's own method sets use_rope_in_attn from no_rope_layers; keep it off
            return build(self, layer_id, *args, **kwargs)
        finally:
            attrs["rope"], attrs["use_rope_in_attn"] = saved

    SmolLM3Model.make_attention = make_attention


def main(argv: list[str]) -> None:
    from specedge.runtime.errors import ExportError

    install_checks()
    fix_smollm3()
    sys.argv = ["onnxruntime_genai.models.builder", *argv]
    try:
        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
    except ExportError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
        sys.exit(ERROR_EXIT)


if __name__ == "__main__":
    main(sys.argv[1:])
