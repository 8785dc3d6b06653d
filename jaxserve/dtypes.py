"""Model dtype names (vLLM's ``--dtype``), without ``auto``.

A leaf module: a converted checkpoint's recorded dtype and the KV cache's name resolve here.
What ``auto`` means depends on the machine (the CPU's matrix units): that is the one rule in
`jaxserve.engine.compute_dtype.resolve_dtype`, which every entry point uses.
"""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16, "float16": jnp.float16, "half": jnp.float16}


def dtype_by_name(name: str):
    """The jnp dtype a named dtype means (``auto`` is not a name here)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}") from None
