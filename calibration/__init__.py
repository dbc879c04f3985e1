"""specedge.calibration."""
