"""specedge.calibration: calibration data and pair measurement (see issue 6; not built yet)."""
