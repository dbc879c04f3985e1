"""A target taken from a pair already exported, so that a new draft costs only its own export.

Trying drafts for one target (`specedge export --target-from PAIR`, and every separate draft
`specedge draft --draft SRC` scores) would otherwise export the same target again each time: for a
multi-GB target that is most of each build. The pair's target files are checked against their
hashes and copied (not hard-linked: the onnx library refuses external data with several links), and
its manifest entry, validation included, is kept as it was. The pair must hold the target the new
export names: the same source, precision, provider and graph form.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specedge.runtime.errors import ExportError
from specedge.runtime.manifest import ModelSpec, load_manifest

from . import quantize, sources


def reused_target(pair: Path, src: sources.Source, precision: str, provider: str,
                  graph: str | None, tmp: Path) -> ModelSpec:
    """Copy the target of the exported `pair` into the staging folder `tmp`; returns its spec.

    Args:
        pair: an exported pair folder.
        src: the resolved target source of the new export.
        precision: the target precision the new export asks for.
        provider: the provider the new export builds for.
        graph: the graph form it asks for (None: any).

    Raises:
        ManifestError: `pair` is not a pair, or its files differ from their hashes.
        ExportError: its target is another model, precision, provider or graph form.
    """
    manifest = load_manifest(pair)
    target = manifest.target
    # the export precision that wrote it (int8-rtn is an int8 model quantized by int8-rtn)
    method = (target.source.get("quantization") or {}).get("method")
    written = next((p for p, m in quantize.EXPORT_METHODS.items() if m == method),
                   target.precision)
    origin = f"{target.source.get('kind')} {target.source.get('origin')}"
    checks = [("source", f"{src.kind} {src.origin}", origin,
               target.source.get("kind") == src.kind
               and sources.same_argument(str(target.source.get("origin")), src.origin)),
              ("precision", precision, written, written == precision),
              ("provider", provider, manifest.provenance.get("provider"),
               manifest.provenance.get("provider") == provider)]
    if graph is not None:
        form = "concat" if graph.startswith("concat") else graph
        checks.append(("graph", form, target.graph, target.graph == form))
    for key, asked, found, same in checks:
        if not same:
            raise ExportError(f"{pair}: its target's {key} is {found}, not {asked}; pass the "
                              "target and options it was exported with, or drop --target-from")
    for rel in target.files:
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(manifest.root / rel, dst)
    return target
