"""The float-zero-point rewrite (HQQ -> uint8 layout + correction) is exact, property-tested."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.exporter.zero_points import block_indicator, pack_zero_points, split_zero_points

needs_onnx = pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="needs onnx")


@given(st.integers(1, 9), st.integers(1, 7), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_split_is_exact_and_on_the_grid(n: int, blocks: int, seed: int) -> None:
    zero = np.random.default_rng(seed).uniform(-3, 18, size=(n, blocks)).astype(np.float32)
    whole, frac = split_zero_points(zero)
    assert whole.dtype == np.uint8 and whole.max() <= 15
    np.testing.assert_array_equal(whole.astype(np.float32) + frac, zero)
    inside = (zero >= -0.5) & (zero <= 15.5)
    assert np.all(np.abs(frac[inside]) <= 0.5)


def test_pack_low_nibble_first_and_padded_per_column() -> None:
    whole = np.array([[1, 2, 3], [15, 0, 7]], dtype=np.uint8)
    np.testing.assert_array_equal(pack_zero_points(whole), [0x21, 0x03, 0x0F, 0x07])


def test_block_indicator_sums_blocks() -> None:
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(x @ block_indicator(10, 4), [6, 22, 17])


def _float_zp_model(path: Path, k: int, n: int, block: int, seed: int) -> np.ndarray:
    """One MatMulNBits with float zero points (HQQ's layout); returns the dequantized weight."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    blocks = k // block
    q = rng.integers(0, 16, size=(n, blocks, block)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(n, blocks)).astype(np.float32)
    zero = rng.uniform(-1.0, 16.0, size=(n, blocks)).astype(np.float32)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    weight = ((q - zero[..., None]) * scales[..., None]).reshape(n, k).T  # [K, N]
    node = helper.make_node("MatMulNBits", ["x", "w", "s", "z"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=block, name="mm")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, n])],
        [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales.reshape(-1), "s"),
         numpy_helper.from_array(zero.reshape(-1), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return weight


@needs_onnx
@pytest.mark.export
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rewrite_matches_the_float_zero_point_model(tmp_path: Path, seed: int) -> None:
    import onnx
    import onnxruntime as ort

    from specedge.exporter.zero_points import rewrite

    k, n, block = 96, 40, 32
    weight = _float_zp_model(tmp_path / "f.onnx", k, n, block, seed)
    assert rewrite(tmp_path / "f.onnx", tmp_path / "u.onnx", accuracy_level=1) == 1
    rewritten = onnx.load(str(tmp_path / "u.onnx"))
    mm = next(nd for nd in rewritten.graph.node if nd.op_type == "MatMulNBits")
    zp = next(i for i in rewritten.graph.initializer if i.name == mm.input[3])
    assert zp.data_type == onnx.TensorProto.UINT8
    x = np.random.default_rng(seed + 100).standard_normal((1, 5, k)).astype(np.float32)
    from specedge.runtime.sessions import SessionConfig, physical_cores, session_options

    # The process-wide pool the runtime uses (another test may already have created it).
    options = session_options(SessionConfig(provider="cpu", intra_op_threads=physical_cores(),
                                             shared_pool=True))
    outs = [ort.InferenceSession(str(tmp_path / f), options,
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for f in ("f.onnx", "u.onnx")]
    reference = x @ weight
    np.testing.assert_allclose(outs[0], reference, rtol=1e-4, atol=1e-4)  # ORT's float-zp rule
    np.testing.assert_allclose(outs[1], reference, rtol=1e-4, atol=1e-4)  # exact rewrite


@needs_onnx
@pytest.mark.export
def test_rewrite_leaves_uint8_models_alone(tmp_path: Path) -> None:
    from specedge.exporter.zero_points import rewrite

    _float_zp_model(tmp_path / "f.onnx", 64, 8, 32, 0)
    rewrite(tmp_path / "f.onnx", tmp_path / "u.onnx")
    assert rewrite(tmp_path / "u.onnx", tmp_path / "u2.onnx") == 0
