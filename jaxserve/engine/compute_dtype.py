"""What ``--dtype`` means on this machine, and why, for the startup log: the one rule.

`serve`, `LLM`, `jaxserve compile` and the model sources all call `resolve_dtype`, so an
executable compiled ahead of time has the dtype the engine that loads it would choose.
Above the kernels layer because ``auto`` depends on what the CPU can do (its matrix units,
or the kind `ModelConfig.matrix_units` names) and whether the oneDNN matmul library loads.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxserve.dtypes import dtype_by_name


def resolve_dtype(name: str, platform: str, matrix_units: str = "auto"):
    """The jnp dtype for ``--dtype name`` on ``platform`` (``auto``: `auto_compute_dtype`)."""
    if name == "auto":
        return auto_compute_dtype(platform, matrix_units)[0]
    return dtype_by_name(name)


def auto_compute_dtype(platform: str, matrix_units: str = "auto") -> tuple[Any, str]:
    """dtype="auto": (dtype, why). On CPU bfloat16 where the CPU computes bf16 products in
    hardware (AMX-BF16 or AVX512-BF16; or ``matrix_units`` names such a kind) and the oneDNN
    matmul library loads -- several times float32's speed at batch sizes above a few rows
    there; float32 elsewhere (bf16 converted to f32 for every product is slower than
    float32). vLLM's CPU build chooses alike. bfloat16 on every accelerator."""
    if platform != "cpu":
        return jnp.bfloat16, f"{platform}: bfloat16"
    from jaxserve.kernels.cpu import matmul

    units = matmul.matrix_units_for(matrix_units)
    source = "this CPU" if matrix_units == "auto" else f"matrix_units={matrix_units}"
    if not units.bf16:
        # The decode GEMV streams bf16 weights without the units (half the bytes: a single
        # stream ~1.65x float32's speed on an AVX2 EPYC), but batches above its few rows go
        # through bf16 converted to f32 (~10 % slower at 64 rows): the user's trade to make.
        return jnp.float32, (f"float32: {source} has no bf16 matrix units (AMX-BF16 / "
                             f"AVX512-BF16; found: {units.describe()}); --dtype bfloat16 "
                             "decodes a few streams faster here (half the bytes to read) "
                             "and large batches slower")
    if not matmul.available():
        return jnp.float32, "float32: the oneDNN matmul library is unavailable (see warning)"
    return jnp.bfloat16, f"bfloat16 on {source}'s matrix units ({units.describe()}) via oneDNN"
