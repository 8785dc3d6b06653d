"""`GpuPlatform`: an NVIDIA GPU, here or named as a `jaxserve compile` target."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxserve.platforms.gpu_targets import GPU_STEP_COMPILER_OPTIONS, GpuTarget
from jaxserve.platforms.interface import Platform


class GpuPlatform(Platform):
    """A GPU: unrolled layers (Triton GEMMs read each layer's weights in place), our Pallas
    attention kernels, bfloat16 for dtype=auto, its own memory per device, and XLA options
    that keep the step from copying weights (platforms/gpu_targets.py)."""

    def __init__(self, name: str = "gpu", target: GpuTarget | None = None) -> None:
        """name: jax's ("gpu" for this host's devices, "cuda" for a compile target);
        target: the GPU compiled for without one (None: the devices here)."""
        self.name = name
        self.target = target
        self.device_memory_bytes = target.device_memory_bytes if target is not None else None

    @property
    def auto_dtype(self) -> Any:
        return jnp.bfloat16

    def attention_backend_name(self, requested: str) -> str:
        if requested == "auto":
            return "pallas"
        if requested == "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU platform only, not "
                             f"{self.name!r}; use 'auto', 'pallas' or 'reference'")
        return requested

    def compile_mesh(self, num_devices: int) -> Any:
        """A (1, num_devices) mesh of the target's compile-only devices (the CUDA plugin)."""
        if self.target is None:
            return None
        from jaxserve.platforms.gpu_targets import topology_mesh

        return topology_mesh(self.target, num_devices)

    def step_compiler_options(self) -> dict[str, Any]:
        return dict(GPU_STEP_COMPILER_OPTIONS)
