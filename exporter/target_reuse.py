"""A target taken from a pair already exported, so that a new draft costs only its own export.

Trying drafts for one target (`specedge export --target-from PAIR`, and every separate draft
`specedge draft --draft SRC` scores) would otherwise export the same target again each time: for a
multi-GB target that is most of each build. The pair's target files are checked against their
hashes and copied (not hard-linked: the onnx library refuses external data with several links), and
its manifest entry, validation included, is kept as it was. The pair must hold the target the new
export names: the same source, precision, provider and graph form. A self-draft beside a copied
fp32 target (`specedge export G --draft-precision int8-rtn --target-from PAIR`) is quantized from
the copied files and validated against them (`fp32_graph`), so its source's weights are not read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specedge.runtime.errors import ExportError, ManifestError
from specedge.runtime.manifest import ModelSpec, load_manifest

from . import onnx_export, quantize, sources


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
