"""KV-cache dtypes (`--kv-cache-dtype`, vLLM's flag).

    auto      the model dtype (float32 on CPU, bfloat16 on GPU)
    float32 / bfloat16 / float16
    fp8       float8 e4m3 (fp8_e4m3 is the same): 1 byte per value, 4x the tokens of a
              float32 cache in the same memory.

fp8 scales: one static per-tensor scale of 1.0, as vLLM uses when a checkpoint ships no
calibrated k/v scales. e4m3 keeps ~3 significant bits over 2^-9 .. 448 whatever the scale,
so K/V activations (|x| well below 448 in the models we serve) lose only relative precision;
write_kv saturates at +-448 rather than overflow to NaN. Per-token or per-head scales would
cost a second array per cache (and 4 bytes per head-token: below the 3.9x capacity target at
head_dim 64) and a change to every backend's signature; not done. int8 KV needs such scales
(its range is fixed), so it is refused until they exist.

Readers dequantize by casting each tile to the query dtype inside their loop: the reference
attention and the Pallas kernel. The C++ CPU kernel reads float32/bfloat16/float16 only, so
with fp8 `auto` picks the reference backend on CPU and `cpu` is refused.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3")
_FIXED = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}


def is_quantized_kv(name: str) -> bool:
    return name.startswith("fp8")


def resolve_kv_cache_dtype(name: str, model_dtype: Any) -> Any:
    """--kv-cache-dtype -> the jnp dtype of the K and V caches."""
    if name == "int8":
        raise ValueError("kv_cache_dtype='int8' is not supported yet (int8 needs per-token "
                         "scales the cache does not store); use fp8 for a 1-byte KV cache")
    if name == "auto":
        return model_dtype
    if name not in _FIXED:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return _FIXED[name]
