"""Export-time quantization of an fp32 ONNX graph, delegated to onnxruntime.quantization.

- int8: dynamic quantization (`quantize_dynamic`, int8 weights, activations quantized at run
  time by DynamicQuantizeLinear + MatMulInteger).
- int4: weight-only MatMulNBits (`MatMulNBitsQuantizer`, RTN by default, block size 32).

Calibrated methods (static int8 QDQ, GPTQ, HQQ, k-quant) belong to `specedge.calibration`.
"""

from __future__ import annotations

from pathlib import Path

from specedge.runtime.errors import ExportError


def int8_dynamic(src: Path, dst: Path) -> None:
    """Dynamic int8 quantization of every MatMul (weights int8, activations at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul"], use_external_data_format=True,
                         extra_options={"MatMulConstBOnly": True})
    except Exception as exc:  # onnxruntime.quantization raises plain exceptions
        raise ExportError(f"{src}: int8 dynamic quantization failed ({exc})") from None


def int4_weight_only(src: Path, dst: Path, block_size: int = 32) -> None:
    """int4 weight-only MatMulNBits (RTN, symmetric, accuracy level 4 = int8 compute on CPU)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    model = onnx.load(str(src))
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True,
                                          accuracy_level=4)
    try:
        quant = MatMulNBitsQuantizer(model, algo_config=config)
        quant.process()
    except Exception as exc:
        raise ExportError(f"{src}: int4 weight-only quantization failed ({exc})") from None
    quant.model.save_model_to_file(str(dst), use_external_data_format=True)
