"""specedge: speculative decoding for edge devices."""

__version__ = "0.1.0"
