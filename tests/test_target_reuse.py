"""`specedge export --target-from PAIR`: a new draft beside a target already exported, which is
copied, not exported again; a pair of another target, precision or provider is refused in one
line before the draft is built."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from specedge.runtime.pair import Pair

pytestmark = [
    pytest.mark.export,
    pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs [export]"),
]


def _count_exports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the models `export_pair` builds from here on."""
    from specedge.exporter import pair as pair_mod

    built: list[str] = []
    real = pair_mod._export_model

    def counted(src: Any, precision: str, name: str, *args: Any, **kw: Any) -> Any:
        built.append(name)
        return real(src, precision, name, *args, **kw)

    monkeypatch.setattr(pair_mod, "_export_model", counted)
    return built


def _reference_gguf(reference_pair_dir: Path) -> Path:
    """The GGUF the reference pair was exported from (skips where it is not here)."""
    from specedge.runtime.manifest import load_manifest

    source = load_manifest(reference_pair_dir).target.source
    gguf = Path(str(source.get("origin")))
    if source.get("kind") != "gguf" or not gguf.is_file():
        pytest.skip(f"the reference pair's GGUF {gguf} is not here")
    return gguf


def _count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(scratch folder, with weights) of each GGUF conversion from here on."""
    from specedge.exporter import sources

    calls: list[tuple[str, bool]] = []
    real = sources.gguf_to_folder

    def recorded(path: Path, out: Path, *, weights: bool = True) -> Path:
        calls.append((out.name, weights))
        return real(path, out, weights=weights)

    monkeypatch.setattr(sources, "gguf_to_folder", recorded)
    return calls


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target and the pair exported from it (fp32 target, int8-rtn self-draft)."""
    from specedge.exporter.pair import ExportOptions, export_pair
    from specedge.exporter.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("reuse")
    target = make_tiny_model("llama", root / "target", seed=3)
    export_pair(ExportOptions(target=str(target), output=root / "pair",
                              draft_precision="int8-rtn"))
    return target, root / "pair"


def test_a_new_draft_beside_a_copied_target_decodes_exactly(
        base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair

    target, pair = base
    small = make_tiny_model("llama", tmp_path / "small", seed=4, num_layers=1)
    built = _count_exports(monkeypatch)
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--draft", str(small),
                                       "--draft-precision", "int8-rtn",
                                       "--target-from", str(pair)])
    assert result.exit_code == 0, result.output
    assert built == ["draft"]  # the target was not exported again
    old, new = load_manifest(pair), load_manifest(tmp_path / "new")
    assert new.target.files == old.target.files  # the same bytes, checked by their hashes
    assert new.target.validation == old.target.validation
    assert new.draft is not None and new.draft.validation["passed"]
    assert new.draft.source["origin"] == str(small)
    assert new.provenance["target_from"] == str(pair.absolute())
    decoded = Pair.load(tmp_path / "new")
    _assert_greedy_exact(decoded)


def _assert_greedy_exact(decoded: Pair, prompts: tuple[str, ...] = (
        "The quick brown", "def add(a, b):"), chat: bool = False, tokens: int = 16) -> int:
    """Greedy speculative decoding on `decoded` equals its target-only decoding, with drafts
    proposed; returns how many were accepted."""
    from specedge.runtime.pair import GenerationConfig

    accepted = 0
    for prompt in prompts:
        ids = decoded.encode_prompt(prompt, chat=chat)
        spec, _, st = decoded.generate_ids(ids, GenerationConfig(max_new_tokens=tokens))
        plain, _, _ = decoded.generate_ids(ids, GenerationConfig(max_new_tokens=tokens,
                                                                 drafter="none"))
        assert spec == plain and st.proposed > 0
        accepted += st.accepted
    return accepted


@pytest.mark.parametrize(("args", "why"), [
    (["--precision", "int8"], "its target's precision is fp32, not int8"),
    (["--precision", "fp32", "--graph", "concat"], "its target's graph is gqa-shared, not concat"),
])
def test_a_pair_of_other_options_is_refused_before_the_draft_is_built(
        base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        args: list[str], why: str) -> None:
    from click.testing import CliRunner

    from specedge.cli import main

    target, pair = base
    built = _count_exports(monkeypatch)
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                       "--draft-precision", "int8-rtn", "--target-from",
                                       str(pair), *args])
    assert result.exit_code != 0
    assert why in result.output and "drop --target-from" in result.output
    assert "Traceback" not in result.output and built == []
    assert not (tmp_path / "new").exists()


def test_a_pair_of_another_target_is_refused(base: tuple[Path, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.tiny import make_tiny_model

    _, pair = base
    other = make_tiny_model("llama", tmp_path / "other", seed=9)
    result = CliRunner().invoke(main, ["export", str(other), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--target-from", str(pair)])
    assert result.exit_code != 0
    assert "its target's source is folder " in result.output
    assert f"not folder {other}" in result.output
    assert not (tmp_path / "new").exists()


def test_the_output_cannot_be_the_pair_it_copies(base: tuple[Path, Path]) -> None:
    from click.testing import CliRunner

    from specedge.cli import main

    target, pair = base
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(pair), "--force",
                                       "--precision", "fp32", "--target-from", str(pair)])
    assert result.exit_code != 0
    assert "writing the output there would delete it" in result.output
    assert (pair / "specedge.json").is_file()


def test_a_gguf_target_beside_a_new_draft_is_not_dequantized_again(
        reference_pair_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference pair's target beside a new int4 draft (the same GGUF): only the draft is
    dequantized; the target's GGUF is not read at all (its config and tokenizer come from the
    pair, which recorded them), and the new pair's tokenizer and special ids are the pair's."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair

    ref = load_manifest(reference_pair_dir)
    gguf = _reference_gguf(reference_pair_dir)
    calls = _count_conversions(monkeypatch)
    draft = tmp_path / "draft.gguf"  # another file: a separate draft (the same is a self-draft)
    shutil.copyfile(gguf, draft)
    result = CliRunner().invoke(main, ["export", str(gguf), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--draft", str(draft),
                                       "--draft-precision", "int4", "--target-from",
                                       str(reference_pair_dir)])
    assert result.exit_code == 0, result.output
    assert calls == [("draft-gguf", True)]
    new = load_manifest(tmp_path / "new")
    assert new.target.files == ref.target.files
    assert new.tokenizer_files == ref.tokenizer_files
    assert (new.bos_token_id, new.eos_token_ids, new.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_ids, ref.pad_token_id)
    assert new.draft is not None and new.draft.validation["passed"]
    pair = Pair.load(tmp_path / "new")
    chats = ("What is the capital of France?", "Write a haiku about the sea.")
    assert _assert_greedy_exact(pair, chats, chat=True, tokens=24) > 0


def test_the_targets_own_gguf_as_draft_is_its_self_draft_quantized_from_the_copy(
        reference_pair_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--draft` naming the target's file again (another spelling of its path) is the
    self-draft; beside the reference pair's copied fp32 target it is quantized from the copy,
    so the GGUF is not read at all, and it is the reference pair's own int4 draft."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter import validate
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair

    gguf = _reference_gguf(reference_pair_dir)
    calls = _count_conversions(monkeypatch)
    monkeypatch.chdir(gguf.parent)
    built = _count_exports(monkeypatch)
    result = CliRunner().invoke(main, ["export", str(gguf), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--draft", f"./{gguf.name}",
                                       "--draft-precision", "int4", "--target-from",
                                       str(reference_pair_dir)])
    assert result.exit_code == 0, result.output
    assert calls == [] and built == ["draft"]
    ref, new = load_manifest(reference_pair_dir), load_manifest(tmp_path / "new")
    assert ref.draft is not None and new.draft is not None
    assert new.draft.validation["passed"]
    assert new.draft.validation["reference"] == validate.COPIED_REFERENCE
    assert new.draft.validation["step_with_past"]["top1_agreement"] >= 0.6
    assert new.draft.files == ref.draft.files  # the reference pair's own int4 self-draft
    assert Pair.load(tmp_path / "new").shares_prompt_kv


def test_a_self_draft_beside_a_copied_target_reads_no_torch_weights(
        base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new self-draft precision for a pair: quantized from its copied fp32 target and
    compared with it, no torch model loaded; it decodes exactly."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter import validate
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair

    def no_torch(*_args: object, **_kw: object) -> None:
        raise AssertionError("a torch model was loaded")

    monkeypatch.setattr(validate, "torch_logits", no_torch)
    target, pair = base
    built = _count_exports(monkeypatch)
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--draft-precision", "int4",
                                       "--target-from", str(pair)])
    assert result.exit_code == 0, result.output
    assert built == ["draft"]
    new = load_manifest(tmp_path / "new")
    assert new.draft is not None and new.draft.precision == "int4"
    assert new.draft.validation["reference"] == validate.COPIED_REFERENCE
    decoded = Pair.load(tmp_path / "new")
    assert decoded.shares_prompt_kv
    _assert_greedy_exact(decoded)


def test_a_pair_exported_from_another_folder_is_matched_by_its_targets_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target written relative to another working folder is the same target: the manifest
    records its absolute path, which the check compares."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.pair import ExportOptions, export_pair
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair

    make_tiny_model("llama", tmp_path / "models" / "t", seed=3)
    monkeypatch.chdir(tmp_path)
    export_pair(ExportOptions(target="models/t", output=Path("pair"), precision="fp32"))
    assert load_manifest(tmp_path / "pair").target.source["path"] == str(tmp_path / "models/t")
    monkeypatch.chdir(tmp_path / "models")
    built = _count_exports(monkeypatch)
    result = CliRunner().invoke(main, ["export", "t", "-o", "../new", "--precision", "fp32",
                                       "--draft-precision", "int8-rtn", "--target-from",
                                       "../pair"])
    assert result.exit_code == 0, result.output
    assert built == ["draft"]
    decoded = Pair.load(tmp_path / "new")
    assert decoded.shares_prompt_kv  # the self-draft's source is the target's
    _assert_greedy_exact(decoded)


def test_a_missing_pair_is_named_as_the_target_from_option(
        base: tuple[Path, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from specedge.cli import main

    target, _ = base
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--target-from",
                                       str(tmp_path / "nope")])
    assert result.exit_code != 0
    assert f"--target-from {tmp_path / 'nope'}: no such pair folder" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "new").exists()


def test_a_hub_target_beside_its_pair_downloads_no_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id (the hub played by a local folder, no network here): the first export downloads
    the weights; a self-draft beside its copied target downloads nothing (its config and
    tokenizer come from the pair)."""
    import fnmatch

    import huggingface_hub
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.exporter.tiny import make_tiny_model
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.pair import Pair

    repo = make_tiny_model("llama", tmp_path / "hub-repo", seed=3)
    fetched: list[list[str]] = []

    def snapshot_download(repo_id: str, *, local_dir: str, allow_patterns: list[str],
                          ignore_patterns: list[str] | None) -> str:
        assert repo_id == "org/tiny"
        names = [p.name for p in repo.iterdir()
                 if any(fnmatch.fnmatch(p.name, a) for a in allow_patterns)
                 and not any(fnmatch.fnmatch(p.name, i) for i in ignore_patterns or [])]
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(repo / name, Path(local_dir) / name)
        fetched.append(sorted(names))
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    runner = CliRunner()
    first = runner.invoke(main, ["export", "org/tiny", "-o", str(tmp_path / "pair"),
                                 "--precision", "fp32"])
    assert first.exit_code == 0, first.output
    assert any(n.endswith(".safetensors") for n in fetched[0])
    assert load_manifest(tmp_path / "pair").target.source["kind"] == "hub"
    result = runner.invoke(main, ["export", "org/tiny", "-o", str(tmp_path / "new"),
                                  "--precision", "fp32", "--draft-precision", "int8-rtn",
                                  "--target-from", str(tmp_path / "pair")])
    assert result.exit_code == 0, result.output
    assert len(fetched) == 1  # no second request
    _assert_greedy_exact(Pair.load(tmp_path / "new"))


def _count_resolves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(model name, with weights) of each source `export_pair` resolves from here on."""
    from specedge.exporter import sources

    calls: list[tuple[str, bool]] = []
    real = sources.resolve

    def recorded(spec: str, work: Path, name: str, *, weights: bool = True) -> Any:
        calls.append((name, weights))
        return real(spec, work, name, weights=weights)

    monkeypatch.setattr(sources, "resolve", recorded)
    return calls


def _strip_source_configs(pair: Path) -> None:
    """Make `pair` as an export before its entries recorded their source's config files."""
    import json

    manifest = json.loads((pair / "specedge.json").read_text())
    for model in ("target", "draft"):
        for key in ("config", "generation_config"):
            manifest["models"][model]["source"].pop(key, None)
    (pair / "specedge.json").write_text(json.dumps(manifest, indent=2))


def test_a_pair_records_its_sources_configs_and_stands_in_for_the_source(
        base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair's entries hold the config files their source folder had; a self-draft beside
    the copied target then resolves no source, and decodes exactly."""
    import json

    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.runtime.manifest import load_manifest

    target, pair = base
    recorded = load_manifest(pair).target.source
    assert recorded["config"] == json.loads((target / "config.json").read_text())
    assert recorded["generation_config"] == json.loads(
        (target / "generation_config.json").read_text())
    resolved = _count_resolves(monkeypatch)
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--draft-precision", "int4",
                                       "--target-from", str(pair)])
    assert result.exit_code == 0, result.output
    assert resolved == []
    old, new = load_manifest(pair), load_manifest(tmp_path / "new")
    assert new.tokenizer_files == old.tokenizer_files
    assert new.provenance["chat_template"] == old.provenance["chat_template"]
    assert (new.bos_token_id, new.eos_token_ids, new.pad_token_id) == (
        old.bos_token_id, old.eos_token_ids, old.pad_token_id)
    assert new.draft is not None and new.draft.source == {
        **{k: v for k, v in old.target.source.items() if k != "quantization"},
        "quantization": new.draft.source["quantization"]}
    from specedge.runtime.pair import Pair

    decoded = Pair.load(tmp_path / "new")
    assert decoded.shares_prompt_kv
    _assert_greedy_exact(decoded)


def test_a_pair_without_its_sources_configs_reads_the_source_without_weights(
        base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair exported before its entries recorded their configs: the source is read (without
    weights) as before, and the self-draft still shares the target's prompt KV."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.runtime.pair import Pair

    target, pair = base
    shutil.copytree(pair, tmp_path / "old")
    _strip_source_configs(tmp_path / "old")
    resolved = _count_resolves(monkeypatch)
    result = CliRunner().invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                       "--precision", "fp32", "--draft-precision", "int4",
                                       "--target-from", str(tmp_path / "old")])
    assert result.exit_code == 0, result.output
    assert resolved == [("target", False)]
    decoded = Pair.load(tmp_path / "new")
    assert decoded.shares_prompt_kv
    _assert_greedy_exact(decoded)


def test_a_pair_with_a_template_from_a_file_does_not_stand_in_for_the_sources(
        base: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair's tokenizer files carry a --chat-template file's template, not the source's:
    a later export without the option reads the source's own."""
    from click.testing import CliRunner

    from specedge.cli import main
    from specedge.runtime.manifest import load_manifest

    target, _ = base
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    runner = CliRunner()
    first = runner.invoke(main, ["export", str(target), "-o", str(tmp_path / "pair"),
                                 "--precision", "fp32", "--chat-template", str(template)])
    assert first.exit_code == 0, first.output
    resolved = _count_resolves(monkeypatch)
    result = runner.invoke(main, ["export", str(target), "-o", str(tmp_path / "new"),
                                  "--precision", "fp32", "--draft-precision", "int4",
                                  "--target-from", str(tmp_path / "pair")])
    assert result.exit_code == 0, result.output
    assert resolved == [("target", False)]
    new = load_manifest(tmp_path / "new")
    assert new.provenance["chat_template"]["source"] == "hf-folder"
    assert (tmp_path / "new" / "chat_template.jinja").read_text() == (
        target / "chat_template.jinja").read_text()
