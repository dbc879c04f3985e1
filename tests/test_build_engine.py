"""`specedge build-engine` and prebuilt TensorRT engines at load time (issue 19).

TensorRT cannot be installed on these machines, so everything that does not need it is tested on
real fixture pairs: the graph-form check, the optimization profile, the provider options, the
machine key and its comparison, the manifest's `engines` entry, the load-time fallback, the
build flow (staging, moves, manifest, --force, --output) with the TensorRT step replaced by a
writer of real EPContext files, and the CLI's one-line errors. The test marked `tensorrt` builds
and runs real engines; it skips where ONNX Runtime's TensorRT EP cannot run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest
from click.testing import CliRunner

from specedge.engine_cli import build_engine
from specedge.exporter import engine as build
from specedge.exporter.engine import (
    EngineOptions,
    build_engines,
    plan_profiles,
    read_context_model,
)
from specedge.exporter.engine_plan import (
    check_graph_form,
    profile_shapes,
    provider_options,
    unavailable_message,
)
from specedge.runtime.engines import (
    TENSORRT_EP,
    EngineKey,
    EngineProfile,
    EngineSpec,
    choose_engine,
    key_mismatch,
    machine_key,
    profile_option,
    tensorrt_version_string,
)
from specedge.runtime.errors import ExportError, InputError, ManifestError
from specedge.runtime.files import sha256_file
from specedge.runtime.loading import engine_choice, load_model
from specedge.runtime.manifest import (
    MANIFEST_NAME,
    PairManifest,
    engine_files_ready,
    load_manifest,
    parse_manifest,
    write_manifest,
)
from specedge.runtime.onnx_file import contrib_ops, read_graph
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.sampling import SamplingParams
from specedge.runtime.sessions import SessionConfig

from .test_onnx_file import encode_varint as _varint

KEY = EngineKey(gpu="Orin", compute_capability="8.7", tensorrt="10.3.0", onnxruntime="1.20.0")
SHA = "0" * 64

# ----------------------------------------------------------------------------- helpers


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _node(op: str, domain: str, attrs: dict[str, int | str], inputs: list[str],
          outputs: list[str]) -> bytes:
    """A NodeProto (input 1, output 2, op_type 4, attribute 5, domain 7)."""
    body = b"".join(_len_field(1, i.encode()) for i in inputs)
    body += b"".join(_len_field(2, o.encode()) for o in outputs)
    body += _len_field(4, op.encode())
    for name, value in attrs.items():  # AttributeProto: name 1, i 3 / s 4, type 20
        attr = _len_field(1, name.encode())
        attr += _int_field(3, value) + _int_field(20, 2) if isinstance(value, int) else \
            _len_field(4, value.encode()) + _int_field(20, 3)
        body += _len_field(5, attr)
    return _len_field(1, body + _len_field(7, domain.encode()))


def context_model(nodes: list[bytes]) -> bytes:
    """An ONNX ModelProto holding `nodes` (what the TensorRT EP dumps, read by `read_graph`)."""
    graph = b"".join(nodes) + _len_field(2, b"ctx")
    return _int_field(1, 10) + _len_field(7, graph)


def epcontext(cache: str, embed: int = 0) -> bytes:
    return _node("EPContext", "com.microsoft", {"embed_mode": embed, "ep_cache_context": cache,
                                                "hardware_architecture": "sm87"},
                 ["input_ids"], ["logits"])


def fake_tensorrt(root: Path, spec: Any, name: str, folder: Path, profile: EngineProfile,
                  opts: EngineOptions, key: EngineKey) -> EngineSpec:
    """What the TensorRT EP leaves in `folder` (an EPContext model naming an engine file
    beside it), described by the same code as a real build."""
    folder.mkdir(parents=True)
    engine = f"TensorrtExecutionProvider_TRTKernel_{name}_sm87.engine"
    (folder / engine).write_bytes(b"engine of " + spec.path.encode())
    (folder / "model_ctx.onnx").write_bytes(context_model([epcontext(engine)]))
    return build.describe_engine(root, spec, folder, profile, opts, key)


@pytest.fixture
def concat_pair(fixtures_dir: Path, tmp_path: Path) -> Path:
    """A concat pair of float models TensorRT can take whole: the tiny fp32 standard-op concat
    target and a copy of it as the draft (a self-draft; the fixture's own draft is int4
    MatMulNBits)."""
    dest = tmp_path / "pair"
    shutil.copytree(fixtures_dir / "tiny-llama-std", dest)
    manifest = load_manifest(dest)
    shutil.rmtree(dest / "draft")
    shutil.copytree(dest / "target", dest / "draft")  # model.onnx and its external data
    draft = dataclasses.replace(manifest.target, path="draft/model.onnx",
                                files={f"draft/{f.name}": sha256_file(f)
                                       for f in sorted((dest / "draft").iterdir())})
    write_manifest(dataclasses.replace(manifest, draft=draft), dest)
    return dest


def with_engine(root: Path, key: EngineKey = KEY, model: str = "target") -> PairManifest:
    """`root`'s manifest with a fake engine for `model` listed (files written)."""
    manifest = load_manifest(root)
    spec = manifest.target if model == "target" else manifest.draft
    assert spec is not None
    opts = EngineOptions(pair=root, batch=2)
    profile = plan_profiles(manifest, opts)[model]
    engine = fake_tensorrt(root, spec, model, root / "engines" / model, profile, opts, key)
    manifest = dataclasses.replace(manifest, engines={**manifest.engines, model: engine})
    write_manifest(manifest, root)
    return manifest


def raw(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / MANIFEST_NAME).read_text())
    return doc


# ----------------------------------------------------------------------------- machine key


def test_tensorrt_version_decoding() -> None:
    assert tensorrt_version_string(100300) == "10.3.0"  # TensorRT 10: major * 10000 + ...
    assert tensorrt_version_string(101602) == "10.16.2"
    assert tensorrt_version_string(8601) == "8.6.1"  # TensorRT 8: major * 1000 + ...


def test_machine_key_says_why_there_is_none() -> None:
    here, why = machine_key(0)
    assert (here is None) != (why is None)
    if here is None:
        assert "GPU" in str(why) or "TensorRT" in str(why)
    else:
        assert here.onnxruntime == ort.__version__


def test_key_comparison() -> None:
    assert key_mismatch(KEY, KEY) is None
    h200 = dataclasses.replace(KEY, gpu="NVIDIA H200", compute_capability="9.0",
                               tensorrt="10.7.0")
    assert key_mismatch(KEY, h200) == ("GPU differs: built for Orin (compute 8.7), this is "
                                       "NVIDIA H200 (compute 9.0)")  # the GPU comes first
    newer = dataclasses.replace(KEY, tensorrt="10.7.0", onnxruntime="1.22.0")
    assert key_mismatch(KEY, newer) == ("versions differ: built with TensorRT 10.3.0 vs 10.7.0 "
                                        "here; onnxruntime 1.20.0 vs 1.22.0 here")
    assert "TensorRT" not in str(key_mismatch(KEY, dataclasses.replace(KEY, onnxruntime="2")))


def _engine(source_sha: str = SHA) -> EngineSpec:
    profile = EngineProfile({"input_ids": (1, 1)}, {"input_ids": (1, 4)}, {"input_ids": (1, 64)})
    return EngineSpec(path="engines/target/model_ctx.onnx",
                      files={"engines/target/model_ctx.onnx": SHA}, key=KEY, precision="fp16",
                      max_batch=1, profile=profile,
                      source={"path": "target/model.onnx", "sha256": source_sha})


def test_engine_choice_and_fallback_messages() -> None:
    trt = [TENSORRT_EP, "CUDAExecutionProvider", "CPUExecutionProvider"]
    engine = _engine()
    for provider in ("cpu", "cuda"):  # other providers never look at engines
        assert choose_engine("target", engine, provider, trt, KEY) == \
            choose_engine("target", None, provider, trt, KEY)
        assert choose_engine("target", engine, provider, trt, KEY).engine is None
        assert choose_engine("target", engine, provider, trt, KEY).message is None
    # the engine is used when everything matches
    assert choose_engine("target", engine, "tensorrt", trt, KEY, model_sha=SHA).engine is engine
    cases = {
        "no engine": (choose_engine("target", None, "tensorrt", trt, KEY),
                      "no prebuilt TensorRT engine"),
        "EP missing": (choose_engine("target", engine, "tensorrt", ["CPUExecutionProvider"],
                                     KEY), "TensorRT EP not available in this onnxruntime"),
        "no library": (choose_engine("draft", engine, "tensorrt", trt, None,
                                     "the TensorRT library (libnvinfer.so.10) is not installed"),
                       "TensorRT EP not available: the TensorRT library"),
        "GPU": (choose_engine("target", engine, "tensorrt", trt,
                              dataclasses.replace(KEY, gpu="NVIDIA H200",
                                                  compute_capability="9.0")), "GPU differs"),
        "versions": (choose_engine("target", engine, "tensorrt", trt,
                                   dataclasses.replace(KEY, tensorrt="10.7.0")),
                     "versions differ"),
        "stale": (choose_engine("target", engine, "tensorrt", trt, KEY, model_sha="1" * 64),
                  "different model file"),
    }
    for label, (choice, expected) in cases.items():
        assert choice.engine is None, label
        assert choice.message is not None and expected in choice.message, (label, choice)
        assert "\n" not in choice.message
        assert choice.message.startswith(("target model:", "draft model:"))
    assert "running target/model.onnx instead" in cases["GPU"][0].message


# ----------------------------------------------------------------------------- graph and profile


def test_graph_form_refused_for_contrib_ops(fixtures_dir: Path) -> None:
    gqa = load_manifest(fixtures_dir / "tiny-llama", verify_hashes=False)
    graph = read_graph(gqa.root / gqa.target.path)
    assert contrib_ops(graph)["com.microsoft.GroupQueryAttention"] == gqa.target.num_layers
    with pytest.raises(ExportError, match="GroupQueryAttention.*--graph concat-standard"):
        check_graph_form(gqa.target, "target", graph)
    # The default concat form keeps the builder's fused ops: batched, but not for TensorRT.
    fused = load_manifest(fixtures_dir / "tiny-llama-concat", verify_hashes=False)
    with pytest.raises(ExportError, match=r"concat with .*RotaryEmbedding.*--graph "
                                          r"concat-standard"):
        check_graph_form(fused.target, "target", read_graph(fused.root / fused.target.path))
    concat = load_manifest(fixtures_dir / "tiny-llama-std", verify_hashes=False)
    check_graph_form(concat.target, "target", read_graph(concat.root / concat.target.path))
    with pytest.raises(ExportError, match=r"the draft model .*MatMulNBits x\d+"):
        plan_profiles(concat, EngineOptions(pair=concat.root))
    # int8-dynamic is standard ops (MatMulInteger) that TensorRT does not take either
    int8 = dataclasses.replace(concat.target, precision="int8")
    with pytest.raises(ExportError, match="is int8.*--graph concat-standard and fp32 models"):
        check_graph_form(int8, "target", read_graph(concat.root / concat.target.path))


def test_read_graph_refuses_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ExportError, match="not a readable ONNX file"):
        read_graph(bad)


def test_profile_from_a_real_manifest(concat_pair: Path) -> None:
    manifest = load_manifest(concat_pair)
    spec, k = manifest.target, manifest.defaults.num_draft_tokens
    graph = read_graph(concat_pair / spec.path)
    profile = profile_shapes(spec, graph.inputs, batch=4, k=k)
    n = spec.max_seq_len
    dynamic = {name for name, dims in graph.inputs if not all(isinstance(d, int) for d in dims)}
    assert set(profile.min) == dynamic  # every dynamic input, nothing else
    assert profile.min[spec.input_ids] == (1, 1)
    assert profile.opt[spec.input_ids] == (4, k + 1)  # verification of K+1 at batch B
    assert profile.max[spec.input_ids] == (4, n)  # the prefill feeds the whole prompt
    assert spec.position_ids and profile.max[spec.position_ids] == (4, n)
    assert profile.max[spec.attention_mask] == (4, n + k + 1)  # ragged rows pad the past
    past = spec.kv.past_key.format(i=spec.num_layers - 1)
    heads, dim = spec.num_kv_heads, spec.head_dim
    assert (profile.min[past], profile.opt[past], profile.max[past]) == (
        (1, heads, 0, dim), (4, heads, n // 2, dim), (4, heads, n - 1, dim))
    kv = [p.format(i=i) for i in range(spec.num_layers)
          for p in (spec.kv.past_key, spec.kv.past_value)]
    assert set(kv) <= set(profile.max)
    for kind in ("min", "opt", "max"):  # the profile round-trips through the manifest parser
        assert all(len(v) == len(profile.max[n_]) for n_, v in getattr(profile, kind).items())


def test_profile_refuses_an_input_the_manifest_does_not_name(concat_pair: Path) -> None:
    spec = load_manifest(concat_pair).target
    inputs = read_graph(concat_pair / spec.path).inputs
    renamed = dataclasses.replace(spec, input_ids="tokens")
    with pytest.raises(ExportError, match="'input_ids'.*does not describe"):
        profile_shapes(renamed, inputs, batch=1, k=3)


def test_provider_options(tmp_path: Path) -> None:
    profile = EngineProfile({"input_ids": (1, 1), "past.0": (1, 2, 0, 16)},
                            {"input_ids": (2, 4), "past.0": (2, 2, 8, 16)},
                            {"input_ids": (2, 64), "past.0": (2, 2, 63, 16)})
    assert profile_option(profile.max) == "input_ids:2x64,past.0:2x2x63x16"
    opts = provider_options(profile, "fp16", tmp_path, device_id=1)
    assert opts["device_id"] == 1
    assert opts["trt_fp16_enable"] is True and opts["trt_int8_enable"] is False
    assert opts["trt_dump_ep_context_model"] is True and opts["trt_ep_context_embed_mode"] == 0
    assert opts["trt_ep_context_file_path"] == opts["trt_engine_cache_path"] == str(tmp_path)
    assert opts["trt_profile_min_shapes"] == "input_ids:1x1,past.0:1x2x0x16"
    assert opts["trt_profile_opt_shapes"] == "input_ids:2x4,past.0:2x2x8x16"
    assert provider_options(profile, "int8", tmp_path)["trt_int8_enable"] is True
    fp32 = provider_options(profile, "fp32", tmp_path)
    assert not fp32["trt_fp16_enable"] and not fp32["trt_int8_enable"]


def test_unavailable_message_says_what_to_install() -> None:
    cpu_only = unavailable_message(["CPUExecutionProvider"], None, jetson=False)
    assert "TensorRT execution provider" in cpu_only and "onnxruntime-gpu" in cpu_only
    assert "tensorrt-cu13-libs" in cpu_only
    jetson = unavailable_message(["CPUExecutionProvider"], None, jetson=True)
    assert "pypi.jetson-ai-lab.io/jp6" in jetson and "JetPack" in jetson
    no_lib = unavailable_message([TENSORRT_EP, "CPUExecutionProvider"],
                                 "the TensorRT library (libnvinfer.so.10) is not installed",
                                 jetson=True)
    assert "libnvinfer" in no_lib and "nvidia-jetpack" in no_lib
    assert all("\n" not in m for m in (cpu_only, jetson, no_lib))


# ----------------------------------------------------------------------------- EPContext files


def test_read_context_model(tmp_path: Path) -> None:
    folder = tmp_path / "engines" / "target"
    folder.mkdir(parents=True)
    (folder / "a.engine").write_bytes(b"plan")
    (folder / "model_ctx.onnx").write_bytes(context_model([epcontext("a.engine")]))
    path, files = read_context_model(folder, tmp_path)
    assert path == "engines/target/model_ctx.onnx"
    assert files == {path: sha256_file(folder / "model_ctx.onnx"),
                     "engines/target/a.engine": hashlib.sha256(b"plan").hexdigest()}


@pytest.mark.parametrize(("nodes", "error"), [
    ([epcontext("a.engine", embed=1)], "embedded"),
    ([epcontext("a.engine"), _node("MatMul", "", {}, ["x", "w"], ["y"])], "whole graph"),
    ([epcontext("../a.engine")], "not a file inside"),
    ([epcontext("/etc/passwd")], "not a file inside"),
    ([epcontext("missing.engine")], "not a file inside"),
    ([], "whole graph"),
])
def test_read_context_model_refuses(tmp_path: Path, nodes: list[bytes], error: str) -> None:
    folder = tmp_path / "engines" / "target"
    folder.mkdir(parents=True)
    (folder / "a.engine").write_bytes(b"plan")
    (tmp_path / "engines" / "a.engine").write_bytes(b"outside")
    (folder / "model_ctx.onnx").write_bytes(context_model(nodes))
    with pytest.raises(ExportError, match=error):
        read_context_model(folder, tmp_path)


def test_read_context_model_wants_one_model(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="wrote 0 EPContext models"):
        read_context_model(tmp_path, tmp_path)


# ----------------------------------------------------------------------------- manifest


def test_manifest_engines_round_trip(concat_pair: Path) -> None:
    before = raw(concat_pair)
    assert "engines" not in before  # a pair without engines keeps its manifest as it was
    manifest = with_engine(concat_pair)
    loaded = load_manifest(concat_pair)
    assert loaded.engines == manifest.engines
    engine = loaded.engines["target"]
    assert engine.key == KEY and engine.max_batch == 2 and engine.precision == "fp16"
    assert engine.source == {"path": "target/model.onnx",
                             "sha256": loaded.target.files["target/model.onnx"]}
    assert parse_manifest(concat_pair, raw(concat_pair)).to_json() == raw(concat_pair)
    assert engine_files_ready(loaded, "target") is None
    # engines are optional artifacts: a pair whose engines folder was not copied still loads
    shutil.rmtree(concat_pair / "engines")
    missing = load_manifest(concat_pair)
    assert "is missing" in str(engine_files_ready(missing, "target"))


def test_tampered_engine_is_refused(concat_pair: Path) -> None:
    manifest = with_engine(concat_pair)
    rel = next(r for r in manifest.engines["target"].files if r.endswith(".engine"))
    (concat_pair / rel).write_bytes(b"something else")
    with pytest.raises(ManifestError, match="sha256 does not match"):
        engine_files_ready(manifest, "target")
    assert engine_files_ready(manifest, "target", verify_hashes=False) is None


def _set(path: str, value: Any):  # noqa: ANN202
    def change(doc: dict[str, Any]) -> None:
        node = doc
        keys = path.split("/")
        for key in keys[:-1]:
            node = node[key]
        if value is KeyError:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return change


BAD_ENGINES = {
    "unknown model": (_set("engines/other", {}), "engines.other"),
    "not an object": (_set("engines", []), "engines"),
    "path escapes": (_set("engines/target/path", "../x.onnx"), "engines.target.path"),
    "absolute path": (_set("engines/target/path", "/etc/passwd"), "engines.target.path"),
    "path not listed": (_set("engines/target/path", "engines/target/other.onnx"),
                        "engines.target.files"),
    "bad sha": (lambda doc: doc["engines"]["target"]["files"].update(
        {"engines/target/model_ctx.onnx": "xyz"}), "engines.target.files"),
    "no key": (_set("engines/target/key", KeyError), "engines.target.key"),
    "long gpu name": (_set("engines/target/key/gpu", "x" * 5000), "engines.target.key.gpu"),
    "empty version": (_set("engines/target/key/tensorrt", ""), "engines.target.key.tensorrt"),
    "precision": (_set("engines/target/precision", "int4"), "engines.target.precision"),
    "batch 0": (_set("engines/target/max_batch", 0), "engines.target.max_batch"),
    "batch bool": (_set("engines/target/max_batch", True), "engines.target.max_batch"),
    "min > max": (_set("engines/target/profile/min/input_ids", [1, 9999]), "input_ids"),
    "rank": (_set("engines/target/profile/opt/input_ids", [1]), "input_ids"),
    "deep dims": (_set("engines/target/profile/max/input_ids", [1] * 9), "input_ids"),
    "negative dim": (_set("engines/target/profile/max/input_ids", [-1, 2]), "input_ids"),
    "bool dim": (_set("engines/target/profile/max/input_ids", [True, 2]), "input_ids"),
    "no profile": (_set("engines/target/profile", KeyError), "engines.target.profile"),
    "empty profile": (_set("engines/target/profile/min", {}), "engines.target.profile.min"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENGINES))
def test_bad_engines_entries_are_refused(concat_pair: Path, case: str) -> None:
    with_engine(concat_pair)
    change, key = BAD_ENGINES[case]
    doc = raw(concat_pair)
    change(doc)
    with pytest.raises(ManifestError, match=key.replace(".", r"\.")):
        parse_manifest(concat_pair, doc)


def test_engine_for_a_missing_draft_is_refused(concat_pair: Path) -> None:
    with_engine(concat_pair, model="draft")
    doc = raw(concat_pair)
    del doc["models"]["draft"]
    with pytest.raises(ManifestError, match=r"engines\.draft"):
        parse_manifest(concat_pair, doc)


# ----------------------------------------------------------------------------- loading


def test_cpu_and_cuda_ignore_engines(concat_pair: Path) -> None:
    manifest = with_engine(concat_pair)
    for provider in ("cpu", "cuda"):
        assert engine_choice(manifest, "target", SessionConfig(provider=provider)).engine is None
    model, message = load_model(manifest, "target", SessionConfig())
    assert model.spec.path == "target/model.onnx" and message is None


def test_tensorrt_falls_back_with_one_line(concat_pair: Path) -> None:
    manifest = with_engine(concat_pair)
    choice = engine_choice(manifest, "target", SessionConfig(provider="tensorrt"))
    here, _ = machine_key(0)
    if TENSORRT_EP in ort.get_available_providers() and here is not None:
        assert choice.message is not None and "GPU differs" in choice.message  # built on Orin
    else:
        assert choice.engine is None
        assert choice.message is not None and "TensorRT EP not available" in choice.message
        assert "running target/model.onnx instead" in choice.message


def test_engine_files_missing_falls_back(concat_pair: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """Where the key matches but the engine files were not copied: the ONNX model, one line."""
    manifest = with_engine(concat_pair)
    shutil.rmtree(concat_pair / "engines")
    from specedge.runtime import loading

    monkeypatch.setattr(loading, "machine_key", lambda device=0: (KEY, None))
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: [TENSORRT_EP, "CPUExecutionProvider"])
    choice = engine_choice(manifest, "target", SessionConfig(provider="tensorrt"))
    assert choice.engine is None
    assert choice.message is not None and "is missing" in choice.message


def test_pair_with_engines_generates_as_before(concat_pair: Path) -> None:
    config = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.0))
    plain = Pair.load(concat_pair).generate_ids([5, 6, 7, 8], config)[0]
    with_engine(concat_pair)
    with_engine(concat_pair, model="draft")
    pair = Pair.load(concat_pair)
    assert pair.engine_notes == {}
    assert pair.generate_ids([5, 6, 7, 8], config)[0] == plain
    assert "engines" in pair.info()


# ----------------------------------------------------------------------------- build flow


def _fake_key(device_id: int = 0) -> EngineKey:
    return KEY


def test_build_in_place_then_up_to_date_then_force(concat_pair: Path) -> None:
    messages: list[str] = []
    report = build_engines(EngineOptions(pair=concat_pair, batch=2), messages.append,
                           compile_fn=fake_tensorrt, key_fn=_fake_key)
    assert set(report.engines) == {"target", "draft"} and report.skipped is None
    assert any("building the target engine" in m for m in messages)
    manifest = load_manifest(concat_pair)
    assert manifest.engines == report.engines
    for name, engine in manifest.engines.items():
        assert engine.path == f"engines/{name}/model_ctx.onnx"
        assert engine_files_ready(manifest, name) is None
    assert not list((concat_pair / "engines").glob(".build-*"))
    again = build_engines(EngineOptions(pair=concat_pair, batch=2), compile_fn=fake_tensorrt,
                          key_fn=_fake_key)
    assert again.skipped is not None and "up to date" in again.skipped
    with pytest.raises(InputError, match="already lists TensorRT engines.*--force"):
        build_engines(EngineOptions(pair=concat_pair, batch=4), compile_fn=fake_tensorrt,
                      key_fn=_fake_key)
    forced = build_engines(EngineOptions(pair=concat_pair, batch=4, force=True),
                           compile_fn=fake_tensorrt, key_fn=_fake_key)
    assert forced.engines["target"].max_batch == 4
    assert load_manifest(concat_pair).engines["target"].max_batch == 4


def test_failed_build_leaves_the_pair_as_it_was(concat_pair: Path) -> None:
    before = (concat_pair / MANIFEST_NAME).read_bytes()

    def fails_on_draft(root: Path, spec: Any, name: str, *args: Any) -> EngineSpec:
        if name == "draft":
            raise ExportError("TensorRT could not build the draft model")
        return fake_tensorrt(root, spec, name, *args)

    with pytest.raises(ExportError, match="draft"):
        build_engines(EngineOptions(pair=concat_pair), compile_fn=fails_on_draft,
                      key_fn=_fake_key)
    assert (concat_pair / MANIFEST_NAME).read_bytes() == before
    assert not (concat_pair / "engines").exists()


def test_build_into_output_copy(concat_pair: Path, tmp_path: Path) -> None:
    before = (concat_pair / MANIFEST_NAME).read_bytes()
    out = tmp_path / "with-engines"
    report = build_engines(EngineOptions(pair=concat_pair, output=out), compile_fn=fake_tensorrt,
                           key_fn=_fake_key)
    assert report.folder == out.absolute()
    assert (concat_pair / MANIFEST_NAME).read_bytes() == before
    assert not (concat_pair / "engines").exists()
    copied = load_manifest(out)
    assert set(copied.engines) == {"target", "draft"}
    with pytest.raises(InputError, match="--force"):
        build_engines(EngineOptions(pair=concat_pair, output=out), compile_fn=fake_tensorrt,
                      key_fn=_fake_key)


def test_build_checks_the_graph_before_tensorrt(fixtures_dir: Path) -> None:
    """A pair TensorRT cannot take is refused on any machine, before TensorRT is looked for."""
    def never(device_id: int = 0) -> EngineKey:
        raise AssertionError("TensorRT was looked for before the graph was checked")

    with pytest.raises(ExportError, match="GroupQueryAttention"):
        build_engines(EngineOptions(pair=fixtures_dir / "tiny-llama"), key_fn=never)


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--batch"):
        EngineOptions(pair=tmp_path, batch=0)
    with pytest.raises(InputError, match="precision"):
        EngineOptions(pair=tmp_path, precision="int4")


# ----------------------------------------------------------------------------- CLI


def _one_line_error(result: Any) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_cli_without_tensorrt_says_what_to_install(concat_pair: Path) -> None:
    if TENSORRT_EP in ort.get_available_providers() and machine_key(0)[0] is not None:
        pytest.skip("TensorRT can run here")
    line = _one_line_error(CliRunner().invoke(build_engine, [str(concat_pair)]))
    assert "TensorRT" in line and "install" in line
    assert "engines" not in raw(concat_pair)


def test_cli_errors_are_one_line(fixtures_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    assert "GroupQueryAttention" in _one_line_error(
        runner.invoke(build_engine, [str(fixtures_dir / "tiny-llama"), "--fp16"]))
    assert "no such pair folder" in _one_line_error(
        runner.invoke(build_engine, [str(tmp_path / "nothing")]))
    usage = runner.invoke(build_engine, [str(tmp_path), "--batch", "0"])
    assert usage.exit_code == 2 and "Traceback" not in usage.output
    help_text = runner.invoke(build_engine, ["--help"]).output
    assert "--int8" in help_text and "--batch" in help_text and "-o, --output" in help_text


# ----------------------------------------------------------------------------- on TensorRT


def _tensorrt_here() -> bool:
    return TENSORRT_EP in ort.get_available_providers() and machine_key(0)[0] is not None


@pytest.mark.tensorrt
@pytest.mark.skipif(not _tensorrt_here(), reason="ONNX Runtime's TensorRT EP cannot run here")
def test_engines_build_and_decode_like_the_onnx_models(concat_pair: Path) -> None:
    result = CliRunner().invoke(build_engine, [str(concat_pair), "--batch", "2", "--fp32"])
    assert result.exit_code == 0, result.output
    manifest = load_manifest(concat_pair)
    assert set(manifest.engines) == {"target", "draft"}
    here, _ = machine_key(0)
    assert here is not None and manifest.engines["target"].key == here
    pair = Pair.load(concat_pair, providers="tensorrt")
    assert pair.engine_notes == {}
    assert pair.target.spec.path == manifest.engines["target"].path
    greedy = SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 1, 4, 1, 5, 9, 2, 6]]
    for ids in prompts:
        target_only = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, sampling=greedy,
                                                              drafter="none"))[0]
        speculative = pair.generate_ids(ids, GenerationConfig(max_new_tokens=24, sampling=greedy,
                                                              drafter="model",
                                                              num_draft_tokens=3))[0]
        assert speculative == target_only
    # two ragged rows in one batch (the profile's batch and padded-past ranges) == batch 1
    texts = ["The sea", "Once upon a time there was"]
    config = GenerationConfig(max_new_tokens=16, sampling=greedy, drafter="model",
                              num_draft_tokens=3)
    batch = pair.generate_batch(texts, config)
    assert [r.tokens for r in batch.results] == [pair.generate(t, config).tokens for t in texts]
