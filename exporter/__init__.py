"""specedge.exporter."""
