"""specedge.runtime."""
