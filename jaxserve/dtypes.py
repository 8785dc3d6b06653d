"""Model dtype names (vLLM's ``--dtype``) and the platform default for ``auto``.

A leaf module: the engine's setup and its model sources both resolve the same name to the
same dtype, and neither has to import the other to do it."""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16, "float16": jnp.float16, "half": jnp.float16}


def resolve_dtype(name: str, platform: str):
    """``auto`` is float32 on CPU (the exact mode) and bfloat16 elsewhere."""
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}") from None
