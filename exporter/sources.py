"""Model sources: a local Hugging Face folder, a hub id, or a GGUF file → a local HF folder.

Every source ends up as a plain Hugging Face folder (config.json, safetensors, tokenizer files)
because that is what both the ONNX Runtime GenAI builder and transformers' validation read.
GGUF files are dequantized by transformers (`from_pretrained(..., gguf_file=...)`, needs `gguf`)
and their weights written straight to safetensors (one copy in memory, tied weights once), with
a config.json that has no `quantization_config`; the GGUF's chat template comes along. Hub ids
are downloaded with `huggingface_hub.snapshot_download` (needs a network; this fails with a clear
message offline).

The tokenizer half of a source lives here too: its files copied into a pair (`copy_tokenizer`,
with a chat template from the folder, the GGUF metadata or a `--chat-template` file, checked by
`template_files`, and a record of which), its special ids, and the check that a draft shares the
target's vocabulary. `check_folder` checks what an export reads from a folder before any model is
built (the files themselves are read by `folder_files`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specedge.runtime.errors import ExportError
from specedge.runtime.files import sha256_file
from specedge.runtime.tokenizer_files import TOKENIZER_FILES

from .checkpoint import check_loading_info
from .folder_files import hf_config, read_config, read_json_file, tokenizer_vocab
from .template_files import (
    check_chat_template,
    gguf_chat_template,
    read_chat_template,
    read_chat_template_text,
    set_chat_template,
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "tokenizer*"]


@dataclass(frozen=True)
class Source:
    """A resolved model source."""

    folder: Path  # a local Hugging Face folder
    kind: str  # "folder" | "hub" | "gguf"
    origin: str  # what the user passed

    def provenance(self) -> dict[str, Any]:
        """The manifest's record of it: a local file or folder also by its absolute path."""
        record: dict[str, Any] = {"kind": self.kind, "origin": self.origin}
        if self.kind != "hub":
            record["path"] = str(Path(self.origin).expanduser().absolute())
        return record


def source_kind(spec: str, name: str) -> str:
    """What a user's model argument names, checked without converting or downloading anything:
    "folder", "gguf" or "hub".

    Raises:
        ExportError: a missing path, a folder without config.json, a file that is not GGUF.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExportError(
                f"{path}: no config.json; pass a Hugging Face model folder, a .gguf file or a "
                f"hub id as the {name}")
        return "folder"
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _is_gguf(path):
            return "gguf"
        raise ExportError(
            f"{path}: not a .gguf file nor a model folder; pass a Hugging Face folder, a .gguf "
            "file or a hub id"
        )
    if path.exists():
        raise ExportError(f"{path}: not a regular file nor a folder (a device, pipe or socket); "
                          f"pass a Hugging Face folder, a .gguf file or a hub id as the {name}")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return "hub"
    raise ExportError(f"{spec}: no such file or folder (and not a hub id like org/name)")


def same_argument(a: str, b: str) -> bool:
    """Whether two model arguments name the same model: hub ids compared as written, local
    paths resolved (`./m.gguf` and its absolute path are one file)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() or pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def resolve(spec: str, work: Path, name: str, *, weights: bool = True) -> Source:
    """Turn a user's model argument into a local HF folder.

    Args:
        spec: a folder, a `.gguf` file, or a hub id like `HuggingFaceTB/SmolLM2-135M-Instruct`.
        work: scratch folder for conversions and downloads.
        name: "target" or "draft", for messages and scratch names.
        weights: False when only its config and tokenizer are read (a target whose model is
            copied from an exported pair): a GGUF is not dequantized, a hub model's weights
            are not downloaded.

    Raises:
        ExportError: missing path, corrupt GGUF, non-HF folder, failed download.
    """
    kind = source_kind(spec, name)
    path = Path(spec).expanduser()
    if kind == "gguf":
        return Source(gguf_to_folder(path, work / f"{name}-gguf", weights=weights), "gguf", spec)
    if kind == "hub":
        return Source(download(spec, work / f"{name}-hub", weights=weights), "hub", spec)
    return Source(path, "folder", spec)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"


def download(repo_id: str, out: Path, *, weights: bool = True) -> Path:
    """Download the files an export needs from the Hugging Face hub (without `weights`: all but
    the safetensors)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - part of the [export] extra
        raise ExportError("huggingface_hub is missing; pip install 'specedge[export]'") from None
    try:
        folder = snapshot_download(repo_id, local_dir=str(out), allow_patterns=_HUB_PATTERNS,
                                   ignore_patterns=None if weights else ["*.safetensors"])
    except Exception as exc:  # the hub client raises many types (offline, 404, auth)
        raise ExportError(
            f"{repo_id}: could not download from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); check the id and the "
            "network, or pass a local folder or .gguf file"
        ) from None
    return Path(folder)


def gguf_to_folder(gguf: Path, out: Path, *, weights: bool = True) -> Path:
    """Dequantize a GGUF checkpoint into a float32 Hugging Face folder.

    Memory: the weights are dequantized once into one torch model, written straight to
    safetensors (tied weights once) and freed before this returns, so the peak is about one
    fp32 copy of the weights plus the GGUF file. The GGUF's `tokenizer.chat_template` becomes
    chat_template.jinja when the file has one. Without `weights`, only the config, tokenizer
    and template are written (in about a second, where dequantizing takes minutes for a 7B).
    """
    import gc

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not _is_gguf(gguf):
        raise ExportError(f"{gguf}: not a GGUF file (bad magic bytes); check the download")
    loaded: Any = None
    try:
        if weights:
            result: Any = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                output_loading_info=True)
            loaded, info = result
            config = loaded.config
        else:
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as exc:  # transformers' own check: gguf (or torch) missing or too old
        raise ExportError(
            f"{gguf}: reading a GGUF file needs a package that is missing or too old "
            f"({_first_line(exc)}); run: pip install -U 'specedge[export]'"
        ) from None
    except Exception as exc:  # gguf / transformers raise many types for corrupt files
        msg = _first_line(exc)
        raise ExportError(
            f"{gguf}: could not read the GGUF file ({msg}); the file is corrupt, truncated or "
            "of an architecture transformers cannot dequantize"
        ) from None
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = cfg.get("architectures") or [
        type(loaded).__name__ if loaded is not None
        else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type"), "")]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if loaded is not None:
        check_loading_info(gguf, info)  # a tensor the file lacks would be random in the export
        tied = bool(cfg.get("tie_word_embeddings"))
        # One copy of the weights: the state dict shares the model's storage; a tied LM head
        # is the embedding matrix itself, so it is left out (transformers re-ties it on load).
        state = {k: v.detach().contiguous() for k, v in loaded.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        generation = loaded.generation_config
        del state, loaded
        gc.collect()
    else:  # what from_pretrained gives a GGUF model (the file holds no generation config)
        generation = GenerationConfig.from_model_config(config)
    if generation is not None:
        generation.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    template = gguf_chat_template(gguf)
    if template is not None:
        set_chat_template(out, template)
    return out


def _first_line(exc: BaseException) -> str:
    """An exception's first line (200 characters at most), else its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def same_vocab(target: Path, draft: Path) -> bool:
    """Whether the draft's tokenizer maps every token to the target's id (else the export
    bridges the two vocabularies: `vocab_bridge`)."""
    return tokenizer_vocab(target) == tokenizer_vocab(draft)


def padded_draft_vocab(target_vocab: int, draft_vocab: int, tokenizer_ids: int) -> int | None:
    """The draft's logits width where it differs from the target's by padding only, else None
    (the same width).

    One tokenizer, embedding tables padded to different sizes: Qwen2.5-0.5B/1.5B/3B have
    151,936 rows, Qwen2.5-7B and larger 152,064, for 151,665 tokens. Such a draft pairs with
    its target: its logits cover the ids below `draft_vocab` (the runtime reads them as a
    reduced-vocabulary draft), and the target's ids past its table are fed to it as id 0.

    Args:
        target_vocab: the target's logits width (its config's vocab_size).
        draft_vocab: the draft's.
        tokenizer_ids: the ids the shared tokenizer produces (its largest id + 1).

    Raises:
        ExportError: the draft's table is larger than the target's, or lacks tokenizer ids.
    """
    if draft_vocab == target_vocab:
        return None
    if draft_vocab > target_vocab:
        raise ExportError(f"the draft's vocabulary ({draft_vocab} ids) is larger than the "
                          f"target's ({target_vocab}); pick a draft whose vocabulary is no "
                          "larger than its target's")
    if tokenizer_ids > draft_vocab:
        raise ExportError(f"the tokenizer has ids up to {tokenizer_ids - 1} but the draft's "
                          f"vocabulary only {draft_vocab}; these models do not share one "
                          "vocabulary")
    return draft_vocab


def special_tokens(hf_dir: Path, config: dict[str, Any]) -> tuple[int | None, list[int],
                                                                  int | None]:
    """The bos id, the eos ids (config, generation_config.json and the tokenizer's eos token)
    and the pad id of an HF folder.

    Raises:
        ExportError: no eos id anywhere.
    """
    eos: list[int] = []
    sources_ = [config]
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        sources_.append(read_json_file(gen))
    for src in sources_:
        value = src.get("eos_token_id")
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, int) and t not in eos:
                eos.append(t)
    tok_cfg = hf_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        cfg = read_json_file(tok_cfg)
        name = cfg.get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str):
            vocab = tokenizer_vocab(hf_dir)
            if name in vocab and vocab[name] not in eos:
                eos.append(vocab[name])
    if not eos:
        raise ExportError(f"{hf_dir}: no eos_token_id in config.json or generation_config.json")
    bos = config.get("bos_token_id")
    pad = config.get("pad_token_id")
    return (bos if isinstance(bos, int) else None, eos, pad if isinstance(pad, int) else None)


def copy_tokenizer(src: Source, dest: Path, template_file: Path | None
                    ) -> tuple[dict[str, str], dict[str, Any]]:
    """Copy the tokenizer files into the pair; returns their hashes and where the chat template
    came from (`{"source": "file" | "hf-folder" | "gguf" | "none", ...}`)."""
    hf_dir = src.folder
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, dest / name)
    cfg_file = dest / "tokenizer_config.json"
    cfg = read_json_file(cfg_file) if cfg_file.is_file() else {}
    jinja = dest / "chat_template.jinja"
    origin: dict[str, Any]
    if template_file is not None:
        text = read_chat_template(template_file)
        jinja.write_text(text, encoding="utf-8")
        if isinstance(cfg, dict) and "chat_template" in cfg:  # no second, different template
            cfg["chat_template"] = text
            cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
        origin = {"source": "file", "file": str(Path(template_file).expanduser().absolute())}
    else:
        if not jinja.is_file() and isinstance(cfg, dict) and isinstance(
                cfg.get("chat_template"), str):
            jinja.write_text(cfg["chat_template"], encoding="utf-8")
        if not jinja.is_file():
            origin = {"source": "none"}
        else:
            # A GGUF's template comes from its metadata (sources.gguf_to_folder).
            origin = {"source": "gguf" if src.kind == "gguf" else "hf-folder",
                      "origin": src.origin}
    files = {name: sha256_file(dest / name) for name in TOKENIZER_FILES
             if (dest / name).is_file()}
    if "tokenizer.json" not in files:
        raise ExportError(f"{hf_dir}: no tokenizer.json (a fast tokenizer is required)")
    if "chat_template.jinja" in files:
        origin["sha256"] = files["chat_template.jinja"]
    return files, origin


def check_folder(folder: Path, name: str, *, own_template: bool) -> None:
    """Check what an export reads from a model folder before any model is built: config.json
    (and a model with at least one layer), generation_config.json and tokenizer_config.json
    when present, tokenizer.json, and, with `own_template`, the folder's chat template rendered
    as `generate --chat` will render it.

    Raises:
        ExportError / InputError: the first problem, in one line naming the file.
    """
    from .archs import arch_for

    read_config(folder)
    config = hf_config(folder)
    arch_for(config, where=str(folder))  # a family the exporter has, before its files
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise ExportError(f"{folder / 'config.json'}: num_hidden_layers is {layers}; the "
                          f"{name} needs at least one layer")
    for extra in ("generation_config.json", "tokenizer_config.json"):
        if (folder / extra).exists():
            read_json_file(folder / extra)
    tokenizer_vocab(folder)
    if own_template:
        from specedge.runtime.chat_template import pick_chat_template

        jinja, cfg_file = folder / "chat_template.jinja", folder / "tokenizer_config.json"
        if jinja.exists():
            check_chat_template(read_chat_template_text(jinja, f"{jinja}"), f"{jinja}",
                                "override it with --chat-template FILE")
        elif cfg_file.exists():
            text = pick_chat_template(read_json_file(cfg_file).get("chat_template"))
            if text:
                check_chat_template(text, f"{cfg_file} (chat_template)",
                                    "override it with --chat-template FILE")


