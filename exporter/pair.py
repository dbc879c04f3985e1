"""Write a pair folder: target (+ draft) ONNX models, tokenizer, validation, manifest.

The folder is written to a temporary sibling and renamed into place at the very end, so an error
or a Ctrl-C never leaves a half-written pair behind. `--force` replaces only a previous specedge
output (a folder with `specedge.json`) that is neither an input nor a folder holding one
(`output.check_output`, shared with `quantize`, `draft` and `build-engine`); the folder's files
are made 0644 and its folders 0755 before the rename (`output.make_readable`).

Quantized models are an fp32 graph (for a self-draft, the fp32 target's own files) quantized in
a child process (`quantize.run_isolated`), so the export's peak memory is one fp32 build. With
no precision asked for on cpu, the CLI picks the fast CPU pair (`cpu_defaults`). The manifest's
provenance records where the chat template came from (HF folder, GGUF metadata, a file, none).
"""

from __future__ import annotations

import dataclasses
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specedge import __version__
from specedge.runtime.errors import ExportError, InputError
from specedge.runtime.files import sha256_file
from specedge.runtime.manifest import (
    DRAFTERS,
    Defaults,
    KVSpec,
    ModelSpec,
    PairManifest,
    write_manifest,
)

from . import (
    folder_files,
    onnx_export,
    quantize,
    sources,
    target_reuse,
    template_files,
    validate,
    vocab_bridge,
)
from .archs import arch_for, default_graph
from .concat_form import RewriteUnsupported
from .output import check_output, require_modules, staged_folder
from .split_head import split_head

GRAPHS = ("gqa-shared", "concat", "concat-standard")
PRECISIONS = ("fp32", "fp16", *quantize.EXPORT_METHODS)  # what an export can write
PROVIDERS = ("cpu", "cuda")  # what the graphs can be built for


@dataclass(frozen=True)
class ExportOptions:
    """What `specedge export` was asked to do.

    Attributes:
        target: HF folder, hub id or .gguf file of the target.
        output: the pair folder to create.
        draft: source of the draft; None means a self-draft of the target when
            `draft_precision` is set, or no draft model at all (n-gram drafting only).
        precision: target precision.
        draft_precision: draft precision (None: no draft model unless `draft` is given, then fp32).
        provider: the execution provider the graphs are built for ("cpu" or "cuda").
        num_draft_tokens: default K written to the manifest.
        force: replace an existing output folder.
        validate: compare every model with torch after export.
        graph: graph form for both models: None for the family's default (archs.py),
            "gqa-shared", "concat" (needed for batched speculative decoding, where
            GroupQueryAttention refuses batch > 1 with several new tokens and a past: the
            builder's graph with its attention rewritten, `concat_form`) or "concat-standard"
            (the torch export, standard ops only: what TensorRT takes; the only concat form of
            families the builder lacks). Both concat forms are "concat" in the manifest.
        draft_graph: the draft's graph form where it differs from `graph` (None: `graph`). A
            gqa-shared draft beside a concat target batches: its steps feed one token per row,
            which GroupQueryAttention takes, in place (`OrtModel._rows_step_shared`; measured
            cheaper, docs/results/batching.md, session 14). Not the default beside
            `graph="concat"`: the builder's GroupQueryAttention graph refuses some configs that
            the rewritten concat form takes (a tiny Phi-3 with partial rotary: its cos_cache
            check), and a self-draft then needs an fp32 build of its own.
        chat_template: a jinja file copied into the pair as chat_template.jinja, in place of
            the source's (HF folder or GGUF metadata).
        drafter: the pair's default drafter (None: "model" with a draft model, else "ngram").
        adaptive: the pair's default for adaptive K (None: the manifest's default).
        target_from: an exported pair whose target (the same source, precision, provider and
            graph form) is copied instead of exported again (`target_reuse`).
    """

    target: str
    output: Path
    draft: str | None = None
    precision: str = "fp32"
    draft_precision: str | None = None
    provider: str = "cpu"
    num_draft_tokens: int = 3
    force: bool = False
    validate: bool = True
    builder_options: dict[str, str] = field(default_factory=dict)
    graph: str | None = None
    draft_graph: str | None = None
    chat_template: Path | None = None
    drafter: str | None = None
    adaptive: bool | None = None
    target_from: Path | None = None

    def __post_init__(self) -> None:
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise InputError(f"drafter {self.drafter!r}: use one of {', '.join(DRAFTERS)}")
        for key, graph in (("graph", self.graph), ("draft-graph", self.draft_graph)):
            if graph is not None and graph not in GRAPHS:
                raise InputError(f"--{key} {graph!r}: use auto, {', '.join(GRAPHS)}")
        for key, value in (("precision", self.precision), ("draft_precision",
                                                            self.draft_precision)):
            if value is not None and value not in PRECISIONS:
                raise InputError(f"--{key.replace('_', '-')} {value!r}: use one of "
                                 f"{', '.join(PRECISIONS)}")
        if "fp16" in (self.precision, self.draft_precision) and self.provider == "cpu":
            raise InputError("fp16 graphs are built for GPUs: add --provider cuda, or use fp32, "
                             "int8, int8-rtn or int4 on cpu")
        if self.provider not in PROVIDERS:
            raise InputError(f"--provider {self.provider!r}: use {' or '.join(PROVIDERS)}")
        if not 1 <= self.num_draft_tokens <= 64:
            raise InputError(f"--num-draft-tokens {self.num_draft_tokens}: use 1..64")


# What `specedge export MODEL -o PAIR` writes on cpu when no precision is asked for: the
# fastest CPU drafting `specedge draft` found for the reference model (docs/results/drafts.md,
# docs/results/fast_pair.md: 1.70x target-only on 44 prompts at K=5 fixed, adaptive 1.53x).
CPU_DEFAULTS: dict[str, Any] = {"precision": "fp32", "draft_precision": "int8-rtn",
                                "drafter": "hybrid", "num_draft_tokens": 5, "adaptive": False}


def cpu_defaults(num_draft_tokens: int | None = None) -> tuple[dict[str, Any], str]:
    """The `ExportOptions` fields of the fast CPU pair (`num_draft_tokens` replaces its K when
    given), and the line that tells the user what was picked and why."""
    picked = dict(CPU_DEFAULTS)
    if num_draft_tokens is not None:
        picked["num_draft_tokens"] = num_draft_tokens
    note = (f"defaults for cpu: fp32 target + int8-rtn self-draft (8-bit weight-only, block 32),"
            f" hybrid drafting (n-gram lookup, else the draft), K={picked['num_draft_tokens']}"
            " - the fastest CPU pair measured (1.7x target-only on SmolLM2-135M); "
            "--precision/--draft-precision choose others, `specedge tune` fits K to this machine")
    return picked, note


@dataclass(frozen=True)
class ExportReport:
    """What an export produced."""

    folder: Path
    manifest: PairManifest
    seconds: float
    peak_rss_mb: float


def _check_output(opts: ExportOptions) -> Path:
    return check_output(opts.output, force=opts.force,
                        inputs=[opts.target, opts.draft, opts.chat_template, opts.target_from])


def _builder_writes(precision: str, opts: ExportOptions) -> bool:
    """Whether the GenAI builder writes `precision` itself (fp32, fp16 and CUDA's int4, whose
    graph keeps fp16 activations), rather than an fp32 build quantized in a child process."""
    if precision in ("fp32", "fp16"):
        return True
    return precision == "int4" and (
        opts.provider == "cuda" or any(k.startswith("int4") for k in opts.builder_options))


def _quantized_self_draft(draft_precision: str | None, opts: ExportOptions) -> bool:
    """Whether a self-draft at `draft_precision` is a quantization of an fp32 target's graph
    (in the target's own graph form) rather than a build of its own."""
    return draft_precision in quantize.EXPORT_METHODS and not _builder_writes(
        draft_precision, opts) and (opts.draft_graph or opts.graph) == opts.graph


@dataclass(frozen=True)
class _Built:
    """One exported model: its manifest entry and, for an fp32 one, its graph in the pair
    (what a self-draft is quantized from)."""

    spec: ModelSpec
    graph: onnx_export.GraphInfo


def _export_model(src: sources.Source, precision: str, name: str, opts: ExportOptions,
                  tmp: Path, work: Path, fp32: onnx_export.GraphInfo | None = None,
                  say: Any = None) -> _Built:
    """Export `src` at `precision` into `tmp / name`.

    Quantized precisions are an fp32 graph (`fp32`, the target's already in the pair, when
    given: a self-draft is not built twice) quantized by `quantize.run_isolated`, whose memory
    goes when it ends: the export's own peak stays one fp32 build.
    """
    say = say or (lambda _msg: None)
    config_dict = folder_files.read_config(src.folder)
    config = folder_files.hf_config(src.folder)
    arch = arch_for(config, where=str(src.folder))
    family_graph = default_graph(arch, config)
    asked = opts.graph or family_graph
    if asked == "gqa-shared" and family_graph == "concat":
        raise ExportError(f"{src.folder}: this {arch.model_type} exports only the concat graph "
                          f"form (the ONNX Runtime GenAI builder does not cover it); drop "
                          f"--graph {asked} or use --graph concat")
    # "concat" of a builder family: the builder's graph, its attention rewritten (concat_form).
    rewrite = asked == "concat" and family_graph == "gqa-shared"
    graph = "gqa-shared" if rewrite else "concat" if asked.startswith("concat") else asked
    method = quantize.EXPORT_METHODS.get(precision)
    if graph == "concat" and precision != "fp32" and method is None:
        raise ExportError(f"{src.folder}: {arch.model_type} exports fp32, "
                          f"{', '.join(quantize.EXPORT_METHODS)} (not {precision}) in the "
                          "standard-op concat form")
    quant: dict[str, Any] | None = None
    if graph == "gqa-shared" and _builder_writes(precision, opts):
        info = onnx_export.build_gqa(src.folder, work / f"{name}-onnx", precision, opts.provider,
                                     work / "cache", dict(opts.builder_options),
                                     work / f"{name}-builder.log")
    else:
        if fp32 is None:
            if graph == "gqa-shared":
                fp32 = onnx_export.build_gqa(src.folder, work / f"{name}-fp32", "fp32",
                                             opts.provider, work / "cache",
                                             dict(opts.builder_options),
                                             work / f"{name}-builder.log")
            else:
                fp32 = onnx_export.export_concat(src.folder, work / f"{name}-fp32", arch, "fp32")
        if method is None:
            info = fp32
        else:
            settings = quantize.QuantSettings(method)
            build = work / f"{name}-onnx"
            build.mkdir(parents=True, exist_ok=True)
            say(f"quantizing the {name} ({method})")
            # The same quantizer as `specedge quantize --method ...`, from the fp32 files.
            peak = quantize.run_isolated(settings, fp32.onnx_path, build / "model.onnx", [],
                                         work)
            info = dataclasses.replace(fp32, onnx_path=build / "model.onnx")
            quant = {"method": method, "block_size": settings.block_size,
                     "accuracy_level": settings.accuracy_level, "symmetric": settings.symmetric,
                     "peak_rss_mib": peak}
            precision = settings.precision  # int8-rtn is an int8 model
    if rewrite:
        try:
            info = onnx_export.concat_from_gqa(info)
        except RewriteUnsupported as exc:
            say(f"{name}: {exc}: exporting the standard-op concat form with torch instead")
            return _export_model(src, precision, name,
                                 dataclasses.replace(opts, graph="concat-standard"), tmp, work,
                                 say=say)
    moved = onnx_export.move_model(info.onnx_path, tmp / name)
    files = {str(p.relative_to(tmp)): sha256_file(p) for p in moved}
    source = {**src.provenance(), "model_type": config_dict.get("model_type"),
              "architecture": (config_dict.get("architectures") or [None])[0],
              **target_reuse.source_configs(src.folder)}
    if quant is not None:
        source["quantization"] = quant
    spec = ModelSpec(
        path=f"{name}/model.onnx",
        files=files,
        precision=precision,
        graph=info.graph,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        max_seq_len=info.max_seq_len,
        vocab_size=info.vocab_size,
        kv=KVSpec(dtype=info.kv_dtype),
        position_ids=info.position_ids,
        logits_dtype=info.kv_dtype,
        min_cache_len=info.min_cache_len,
        source=source,
    )
    if spec.graph == "gqa-shared":
        say(f"splitting the {name}'s head")
        spec = split_head(tmp, spec)
    return _Built(spec, dataclasses.replace(info, onnx_path=tmp / name / "model.onnx"))


def export_pair(opts: ExportOptions, progress: Any = None) -> ExportReport:
    """Export a target (and a draft) into a validated pair folder, atomically.

    Args:
        opts: the export options.
        progress: optional callable taking a status string (the CLI passes a spinner).

    Raises:
        InputError / ExportError: bad arguments, unsupported or mismatched models, failed
            validation. Nothing is left at `opts.output` on failure.
    """
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    out = _check_output(opts)
    if opts.chat_template is not None:
        template_files.read_chat_template(opts.chat_template)  # a bad file fails now
    require_modules("export")
    with staged_folder(out) as tmp, \
            tempfile.TemporaryDirectory(prefix="specedge-export-",
                                        ignore_cleanup_errors=True) as work:
        manifest = _export_into(opts, out, tmp, Path(work), say)
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    return ExportReport(out, manifest, time.perf_counter() - start, peak)


def _export_into(opts: ExportOptions, out: Path, tmp: Path, work: Path,
                 say: Callable[[str], None]) -> PairManifest:
    """Export the pair of `opts` into the staging folder `tmp` (`work`: scratch space) and
    write its manifest; returns it (its root `out`, where the pair goes next)."""
    draft_precision = opts.draft_precision or ("fp32" if opts.draft is not None else None)
    # A self-draft: no --draft, or the target's own file again (converted once, not twice).
    self_draft = draft_precision is not None and (
        opts.draft is None or sources.same_argument(opts.draft, opts.target))
    reused: ModelSpec | None = None
    fp32_target: onnx_export.GraphInfo | None = None
    if opts.target_from is not None:  # a mismatch fails before anything is read or built
        say(f"copying the target from {opts.target_from}")
        reused = target_reuse.reused_target(opts.target_from, opts.target, opts.precision,
                                            opts.provider, opts.graph, tmp)
        fp32_target = target_reuse.fp32_graph(reused, tmp)
    # A self-draft of an fp32 target is quantized from the target's files.
    quantized_from = fp32_target if self_draft and _quantized_self_draft(
        draft_precision, opts) else None
    # A copied target needs its weights only for a self-draft not quantized from its files;
    # without them its config and tokenizer come from the pair when it records them.
    target_src = None
    if reused is not None and opts.target_from is not None and not (
            self_draft and quantized_from is None):
        target_src = target_reuse.source_from_pair(opts.target_from, reused, opts.target,
                                                   opts.chat_template, work / "target-pair")
        if target_src is not None:
            say(f"reading the target's config and tokenizer from {opts.target_from}")
    if target_src is None:
        say("resolving the target")
        target_src = sources.resolve(opts.target, work, "target", weights=reused is None or (
            self_draft and quantized_from is None))
    draft_src: sources.Source | None = None
    if self_draft:
        draft_src = target_src  # the same model at another precision
    elif opts.draft is not None:
        say("resolving the draft")
        draft_src = sources.resolve(opts.draft, work, "draft")
    # Everything the export reads from the folders, checked before any model is built.
    sources.check_folder(target_src.folder, "target", own_template=opts.chat_template is None)
    bridged = draft_src is not None and draft_src.folder != target_src.folder and \
        not sources.same_vocab(target_src.folder, draft_src.folder)
    if draft_src is not None and draft_src.folder != target_src.folder:
        sources.check_folder(draft_src.folder, "draft", own_template=False)
        if bridged:  # refused before anything is built when it shares too little
            vocab_bridge.for_folders(target_src.folder, draft_src.folder)
    if reused is not None:
        target = reused
    else:
        say(f"exporting the target ({opts.precision})")
        built = _export_model(target_src, opts.precision, "target", opts, tmp, work)
        target = built.spec
        if self_draft and built.spec.precision == "fp32" and _quantized_self_draft(
                draft_precision, opts):
            quantized_from = built.graph
    draft, bridge = None, None
    if draft_src is not None and draft_precision is not None:
        say(f"exporting the draft ({draft_precision})")
        draft_opts = dataclasses.replace(opts, graph=opts.draft_graph or opts.graph)
        draft = _export_model(draft_src, draft_precision, "draft", draft_opts, tmp, work,
                              fp32=quantized_from, say=say).spec
        if reused is not None and self_draft:  # the copied target's record of their source
            own = {"quantization": draft.source["quantization"]} \
                if "quantization" in draft.source else {}
            draft = dataclasses.replace(draft, source={
                **{k: v for k, v in reused.source.items() if k != "quantization"}, **own})
        tokenizer_ids = 1 + max(folder_files.tokenizer_vocab(target_src.folder).values())
        if bridged:
            bridge = vocab_bridge.for_folders(target_src.folder, draft_src.folder,
                                              target.vocab_size, draft.vocab_size)
            say(bridge.summary())
            draft = vocab_bridge.write_bridged_draft(tmp, work, draft, bridge,
                                                     target.vocab_size)
        elif (width := sources.padded_draft_vocab(target.vocab_size, draft.vocab_size,
                                                  tokenizer_ids)) is not None:
            say(f"the draft's vocabulary is padded to {width} ids, the target's to "
                f"{target.vocab_size}: its logits cover the first {width}")
            draft = _pad_draft_vocab(tmp, draft, target.vocab_size)
    tokenizer_files, template = sources.copy_tokenizer(target_src, tmp, opts.chat_template)
    bos, eos, pad = sources.special_tokens(target_src.folder,
                                           folder_files.read_config(target_src.folder))
    if opts.validate:
        say("validating the draft against the copied target" if reused is not None and
            quantized_from is not None else "validating against torch")
        target, draft = validate.validate_pair(
            tmp, target, draft, target_src.folder, draft_src.folder if draft_src else None,
            opts.provider, bridge, validate_target=reused is None)
    defaults = Defaults(drafter=opts.drafter or ("model" if draft else "ngram"),
                        num_draft_tokens=opts.num_draft_tokens)
    if opts.adaptive is not None:
        defaults = dataclasses.replace(defaults, adaptive=opts.adaptive)
    manifest = PairManifest(
        root=out, target=target, draft=draft, vocab_size=target.vocab_size,
        bos_token_id=bos, eos_token_ids=tuple(eos), pad_token_id=pad,
        tokenizer_files=tokenizer_files, defaults=defaults,
        provenance={"specedge": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime()),
                    "provider": opts.provider, "chat_template": template,
                    **({"target_from": str(opts.target_from.absolute())}
                       if opts.target_from is not None else {})},
    )
    write_manifest(manifest, tmp)
    return manifest


def _pad_draft_vocab(tmp: Path, draft: ModelSpec, vocab_size: int) -> ModelSpec:
    """The draft's spec in a pair of `vocab_size` ids when its own table is smaller
    (`sources.padded_draft_vocab`): its logits map to ids 0..n-1 (`vocab_ids`, as a
    reduced-vocabulary draft) and the ids past its table are fed to it as 0
    (`input_vocab_size`)."""
    import numpy as np

    rel = "draft/vocab_ids.npy"
    np.save(tmp / rel, np.arange(draft.vocab_size, dtype=np.int64), allow_pickle=False)
    return dataclasses.replace(draft, files={**draft.files, rel: sha256_file(tmp / rel)},
                               vocab_size=vocab_size, vocab_ids=rel,
                               input_vocab_size=draft.vocab_size)
