"""Platform kernels (the lowest layer: imports nothing else of jaxserve)."""
