"""The compute dtype for ``--dtype auto`` on this machine, and its reason for the startup log.

Above the kernels layer because the answer depends on what the CPU can do (its matrix units)
and whether the oneDNN matmul library loads; named dtypes resolve in the leaf `jaxserve.dtypes`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxserve.dtypes import resolve_dtype as resolve_named_dtype


def resolve_dtype(name: str, platform: str, matrix_units: str = "auto"):
    """The jnp dtype for ``--dtype name`` (``auto``: `auto_compute_dtype`)."""
    if name == "auto":
        return auto_compute_dtype(platform, matrix_units)[0]
    return resolve_named_dtype(name, platform)


def auto_compute_dtype(platform: str, matrix_units: str = "auto") -> tuple[Any, str]:
    """dtype="auto": (dtype, why). On CPU bfloat16 where the CPU computes bf16 products in
    hardware (AMX-BF16 or AVX512-BF16) and the oneDNN matmul library loads -- several times
    float32's speed at batch sizes above a few rows there; float32 elsewhere (bf16 converted
    to f32 for every product is slower than float32). vLLM's CPU build chooses alike."""
    if platform != "cpu":
        return jnp.bfloat16, f"{platform}: bfloat16"
    if matrix_units == "none":
        return jnp.float32, "float32: matrix_units=none (as on a CPU without bf16 units)"
    from jaxserve.kernels.cpu import matmul

    units = matmul.detect_matrix_units()
    if not units.bf16:
        return jnp.float32, (f"float32: this CPU has no bf16 matrix units (AMX-BF16 / "
                             f"AVX512-BF16; found: {units.describe()})")
    if not matmul.available():
        return jnp.float32, "float32: the oneDNN matmul library is unavailable (see warning)"
    return jnp.bfloat16, f"bfloat16 on the CPU's matrix units ({units.describe()}) via oneDNN"
