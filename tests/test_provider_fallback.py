"""A GPU provider that ONNX Runtime cannot start is a clear one-line error, not a silent CPU run.

ONNX Runtime creates a session on the CPU, with no error, when the CUDA or TensorRT provider of an
onnxruntime-gpu build cannot load its libraries or find a driver (measured with onnxruntime-gpu
1.31.1 on the CPU-only development machine: `specedge generate --providers cuda` ended in a
traceback from the device argmax's first CUDA buffer). A CPU build asked for CUDA does the same,
which is how these tests reproduce it: the runtime is made to believe the build has CUDA.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
from click.testing import CliRunner

from specedge.cli import main
from specedge.runtime.errors import InputError
from specedge.runtime.pair import Pair
from specedge.runtime.sessions import fallback_message

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


@pytest.mark.parametrize(("asked", "ran_on", "expected"), [
    ("cpu", [CPU], None),
    ("cuda", [CUDA, CPU], None),
    ("tensorrt", [TRT, CUDA, CPU], None),
    ("cuda", [CPU], True),
    ("tensorrt", [CPU], True),
    ("cuda", [], True),
    ("tensorrt", [CUDA, CPU], False),  # still on the GPU: a warning
])
def test_fallback_message(asked: str, ran_on: list[str], expected: bool | None) -> None:
    said = fallback_message(asked, ran_on, "the target model")
    assert (None if said is None else said[0]) is expected
    if said is not None:
        assert "\n" not in said[1] and said[1].startswith("the target model: ")
        assert f"specedge doctor --providers {asked}" in said[1]


@pytest.fixture
def cuda_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU build of onnxruntime says it has the CUDA provider (and then cannot start it)."""
    real = ort.get_available_providers
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, *real()])


@pytest.mark.filterwarnings("ignore:Specified provider")
@pytest.mark.parametrize(("providers", "model"), [(("cuda", "cuda"), "target"),
                                                  (("cpu", "cuda"), "draft")])
def test_pair_load_refuses_a_silent_cpu_fallback(
        tiny_pair_dir: Path, cuda_claimed: None, providers: tuple[str, str], model: str) -> None:
    with pytest.raises(InputError, match=f"^the {model} model: CUDAExecutionProvider was asked "
                                         "for, but ONNX Runtime could not start it") as info:
        Pair.load(tiny_pair_dir, providers=providers)
    assert "specedge doctor --providers cuda" in str(info.value)


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_cli_says_it_in_one_line(tiny_pair_dir: Path, cuda_claimed: None) -> None:
    result = CliRunner().invoke(main, ["generate", str(tiny_pair_dir), "hi", "--max-new-tokens",
                                       "4", "--providers", "cuda"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the target model: "), lines
    assert "or use --providers cpu" in lines[0]


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_cuda_export_validates_on_cpu_when_cuda_does_not_start(
        tiny_pair_dir: Path, cuda_claimed: None, monkeypatch: pytest.MonkeyPatch) -> None:

    from specedge.exporter import validate
    from specedge.runtime.backend import OrtModel
    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.sessions import SessionConfig

    # A GPU is found (the driver answers), but the CUDA provider does not start.
    monkeypatch.setattr(validate, "validation_provider", lambda requested: (requested, None))
    spec = load_manifest(tiny_pair_dir).target
    ids = validate.validation_ids(spec.vocab_size, None)
    model = OrtModel(tiny_pair_dir, spec, "target", SessionConfig())
    reference = model.forward(model.new_cache(1, 64), ids)[0]
    result = validate.validate_model(tiny_pair_dir, spec, "target", reference, ids,
                                     provider="cuda")
    assert result["passed"] and result["provider"] == CPU
    assert result["note"].startswith("validated on CPU, not cuda: ONNX Runtime could not start")


class _TensorRTFails:
    """onnxruntime.InferenceSession whose TensorRT provider raises at creation, as onnxruntime-gpu
    does without the TensorRT libraries (its own retry, which prints a banner, must be off)."""

    real = ort.InferenceSession

    def __new__(cls, path: str, options: object, providers: list, **kwargs: object) -> object:
        assert kwargs.get("enable_fallback") == 0
        first = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
        if first == TRT:
            raise RuntimeError("/onnxruntime_src/onnxruntime/python/onnxruntime_pybind_state.cc:"
                               "729 void f(PySessionOptions&, const ProviderOptions&) Please "
                               "install TensorRT libraries")
        return cls.real(path, options, providers=providers, **kwargs)


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_a_provider_that_raises_is_named_with_its_reason(
        tiny_pair_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = ort.get_available_providers
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TRT, CUDA, *real()])
    monkeypatch.setattr(ort, "InferenceSession", _TensorRTFails)
    with pytest.raises(InputError, match=r"^the target model: TensorrtExecutionProvider was asked "
                       r"for, but ONNX Runtime could not start it \(Please install TensorRT "
                       r"libraries\) and fell back to CPUExecutionProvider;"):
        Pair.load(tiny_pair_dir, providers=("tensorrt", "cpu"))
    assert capsys.readouterr().out == ""


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_a_broken_file_on_a_gpu_provider_is_still_a_broken_file(
        tiny_pair_dir: Path, tmp_path: Path, cuda_claimed: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from specedge.runtime.errors import ModelError
    from specedge.runtime.sessions import SessionConfig, start_session

    monkeypatch.setattr(ort, "InferenceSession", _TensorRTFails)
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(ModelError, match="could not load the target model .*; re-export"):
        start_session(bad, SessionConfig(provider="cuda"), "the target model", "re-export")


def test_fp32_group_query_attention_on_cuda(tiny_pair_dir: Path, concat_dir: Path) -> None:
    """ONNX Runtime's CUDA GroupQueryAttention takes fp16/bf16 only: an fp32 gqa-shared model on
    CUDA would send its attention and KV cache to the CPU every call (a warning), and CUDA
    graphs cannot capture it at all (an error before the session, not "CUDA could not start")."""
    import dataclasses

    from specedge.runtime.manifest import load_manifest
    from specedge.runtime.sessions import SessionConfig, cuda_attention_problem

    spec = load_manifest(tiny_pair_dir).target
    assert spec.graph == "gqa-shared" and spec.kv.dtype == "float32"
    assert cuda_attention_problem(spec, SessionConfig()) is None
    warn = cuda_attention_problem(spec, SessionConfig(provider="cuda"))
    assert warn is not None and not warn[0] and "--precision fp16" in warn[1]
    error = cuda_attention_problem(spec, SessionConfig(provider="cuda", cuda_graph=True))
    assert error is not None and error[0] and "CUDA graphs" in error[1]
    fp16 = dataclasses.replace(spec, kv=dataclasses.replace(spec.kv, dtype="float16"))
    assert cuda_attention_problem(fp16, SessionConfig(provider="cuda", cuda_graph=True)) is None
    concat = load_manifest(concat_dir).target
    assert cuda_attention_problem(concat, SessionConfig(provider="cuda")) is None


@pytest.mark.filterwarnings("ignore:Specified provider")
def test_cuda_graphs_refuse_an_fp32_gqa_model_in_one_line(tiny_pair_dir: Path,
                                                          cuda_claimed: None) -> None:
    result = CliRunner().invoke(main, ["generate", str(tiny_pair_dir), "hi", "--max-new-tokens",
                                       "4", "--providers", "cuda", "--cuda-graph"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "GroupQueryAttention has no CUDA kernel" in lines[0], lines
