"""A target taken from a pair already exported, so that a new draft costs only its own export.

Trying drafts for one target (`specedge export --target-from PAIR`, and every separate draft
`specedge draft --draft SRC` scores) would otherwise export the same target again each time: for a
multi-GB target that is most of each build. The pair's target files are checked against their
hashes and copied (not hard-linked: the onnx library refuses external data with several links), and
its manifest entry, validation included, is kept as it was. The pair must hold the target the new
export names: the same source, precision, provider and graph form. A self-draft beside a copied
fp32 target (`specedge export G --draft-precision int8-rtn --target-from PAIR`) is quantized from
the copied files and validated against them (`fp32_graph`), so its source's weights are not read.
Each model's manifest entry records the config files of the folder it was exported from
(`source_configs`); with them and the pair's tokenizer files the target's source is not read at all
(`source_from_pair`: no GGUF metadata parsed, no hub request), else only its config and tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from specedge.runtime.errors import ExportError, ManifestError
from specedge.runtime.files import json_dumps
from specedge.runtime.manifest import ModelSpec, load_manifest, read_manifest

from . import folder_files, onnx_export, quantize, sources

# The source folder's files a model's manifest entry records (`source_configs`), by key.
CONFIG_FILES = {"config": "config.json", "generation_config": "generation_config.json"}


def reused_target(pair: Path, target: str, precision: str, provider: str,
                  graph: str | None, tmp: Path) -> ModelSpec:
    """Copy the target of the exported `pair` into the staging folder `tmp`; returns its spec.

    Args:
        pair: an exported pair folder.
        target: the new export's target argument (checked before it is resolved).
        precision: the target precision the new export asks for.
        provider: the provider the new export builds for.
        graph: the graph form it asks for (None: any).

    Raises:
        ManifestError: `pair` is not a pair, or its files differ from their hashes (the
            message names --target-from).
        ExportError: its target is another model, precision, provider or graph form.
    """
    kind = sources.source_kind(target, "target")
    try:
        manifest = load_manifest(pair)
    except ManifestError as exc:
        raise ManifestError(f"--target-from {exc}") from exc
    spec = manifest.target
    # the export precision that wrote it (int8-rtn is an int8 model quantized by int8-rtn)
    method = (spec.source.get("quantization") or {}).get("method")
    written = next((p for p, m in quantize.EXPORT_METHODS.items() if m == method),
                   spec.precision)
    # a local source's absolute path (`Source.provenance`): the origin as written may be
    # relative to the folder that pair was exported from
    recorded = str(spec.source.get("path", spec.source.get("origin")))
    checks = [("source", f"{kind} {target}", f"{spec.source.get('kind')} {recorded}",
               spec.source.get("kind") == kind and sources.same_argument(recorded, target)),
              ("precision", precision, written, written == precision),
              ("provider", provider, manifest.provenance.get("provider"),
               manifest.provenance.get("provider") == provider)]
    if graph is not None:
        form = "concat" if graph.startswith("concat") else graph
        checks.append(("graph", form, spec.graph, spec.graph == form))
    for key, asked, found, same in checks:
        if not same:
            raise ExportError(f"{pair}: its target's {key} is {found}, not {asked}; pass the "
                              "target and options it was exported with, or drop --target-from")
    for rel in spec.files:
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(manifest.root / rel, dst)
    return spec


def fp32_graph(spec: ModelSpec, tmp: Path) -> onnx_export.GraphInfo | None:
    """The copied target's graph as a self-draft is quantized from (the export's own fp32
    target, `pair._export_model`'s `fp32`): an fp32 target in the builder's form, else None."""
    if spec.precision != "fp32" or spec.graph != "gqa-shared":
        return None
    return onnx_export.GraphInfo(
        onnx_path=tmp / spec.path, graph=spec.graph, num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_seq_len=spec.max_seq_len,
        vocab_size=spec.vocab_size, kv_dtype=spec.kv.dtype, position_ids=spec.position_ids,
        genai_config=None, min_cache_len=spec.min_cache_len)


def source_configs(folder: Path) -> dict[str, Any]:
    """The config files of the HF `folder` a model is exported from, for its manifest entry's
    source record (config.json always; generation_config.json when the folder has one)."""
    return {key: folder_files.read_json_file(folder / name) for key, name in CONFIG_FILES.items()
            if (folder / name).is_file()}


def source_from_pair(pair: Path, spec: ModelSpec, target: str, chat_template: Path | None,
                     out: Path) -> sources.Source | None:
    """The target's source as an export without its weights reads it (config, generation
    config, tokenizer, chat template), written into `out` from the pair `pair` whose target
    `spec` was copied; None when the pair cannot stand in for it: exported before its entry
    recorded the configs, or with a chat template from a file (the pair's tokenizer config
    then holds that template, not the source's) and no --chat-template now."""
    manifest = read_manifest(pair)  # its hashes: `reused_target` checked them
    template = manifest.provenance.get("chat_template") or {}
    if "config" not in spec.source or (template.get("source") == "file" and
                                       chat_template is None):
        return None
    out.mkdir(parents=True, exist_ok=True)
    for key, name in CONFIG_FILES.items():
        if isinstance(spec.source.get(key), dict):
            (out / name).write_text(json_dumps(spec.source[key]), encoding="utf-8")
    for rel in manifest.tokenizer_files:
        shutil.copy2(manifest.root / rel, out / rel)
    return sources.Source(out, str(spec.source.get("kind")), target)
