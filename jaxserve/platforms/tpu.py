"""`TpuPlatform`: the seam for TPUs, not supported yet beyond what lowers everywhere."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxserve.platforms.interface import Platform


class TpuPlatform(Platform):
    """A TPU, with what works today: the reference attention (JAX's TPU ragged paged
    attention wants another KV layout, combined K/V pages, not adapted yet), unrolled layers,
    bfloat16 for dtype=auto, XLA's default options. Not tested on a TPU."""

    name = "tpu"

    @property
    def auto_dtype(self) -> Any:
        return jnp.bfloat16

    def attention_backend_name(self, requested: str) -> str:
        if requested == "auto":
            return "reference"
        if requested == "cpu":
            raise ValueError("attention backend 'cpu' runs on the CPU platform only, not "
                             "'tpu'; use 'auto' or 'reference'")
        if requested == "pallas":
            raise ValueError("attention backend 'pallas' compiles Triton kernels for a GPU; "
                             "on tpu use 'auto' or 'reference' ('pallas-interpret' runs the "
                             "kernels in slow interpret mode, for tests)")
        return requested
