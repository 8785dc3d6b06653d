"""The gpu_compile tier's gate, shared by its modules: the CUDA plugin (the gpu-compile
extras, .venv-gpu) with JAX_PLATFORMS=cpu, so the CUDA compiler runs with no GPU."""

from __future__ import annotations

import os

import pytest


def plugin_ready() -> bool:
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("JAX_PLATFORMS") == "cpu"


def skip_module_unless_plugin_ready() -> None:
    """Skip the calling test module (at import) where the plugin cannot compile."""
    if not plugin_ready():
        pytest.skip("needs the gpu-compile extras and JAX_PLATFORMS=cpu "
                    "(make test-gpu-compile)", allow_module_level=True)
