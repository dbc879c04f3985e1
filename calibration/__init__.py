"""specedge.calibration: calibration data, calibrated quantization of a pair, and measurement
(`tune`, the `draft` search). It may import the exporter and the runtime, never the CLI."""
