"""C++ ragged paged attention for the XLA CPU backend (through the XLA FFI).

`paged_attention` has the signature and semantics of
`pallas_kernels.reference.ragged_paged_attention_reference` (plus its optional
`sliding_window` and `logits_soft_cap`), and reads only the pages the block
tables name, so it can take a whole multi-layer cache. The kernel is compiled on
first use (see `loader`); `available()` says whether that works here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.cpu.loader import (
    TARGET_NAME,
    WRITE_KV_TARGET,
    CpuAttentionBuildError,
    available,
    build,
    register,
)
from jaxserve.quantization.kv import QuantizedKV

__all__ = ["paged_attention", "write_kv", "available", "build", "register",
           "CpuAttentionBuildError"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_EMPTY_SCALES = np.zeros((0,), np.int8)
# Cache dtypes whose XLA:CPU scatter is not in place (it computes them in f32, rewriting the
# whole cache on every write): written by the library instead.
_WRITTEN_BY_THE_LIBRARY = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def write_kv(k_cache, v_cache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """`pallas_kernels.write_kv`'s contract (rows into the caches at their slots, -1 skipped),
    in place. A bf16 / f16 cache goes through the library's write, its results aliasing the
    (donated) caches: XLA's scatter rewrote the whole cache per layer (33 ms each for 12.6M
    values, ~2 s per SmolLM2 decode step with a 256 MiB cache; the library writes only the
    rows). float32, int8 and fp8 caches keep XLA's scatter (in place for the first two)."""
    from pallas_kernels import write_kv as xla_write_kv

    if isinstance(k_cache, QuantizedKV) or k_cache.dtype not in _WRITTEN_BY_THE_LIBRARY:
        return xla_write_kv(k_cache, v_cache, k, v, slot_mapping)
    register()
    spec = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    call = jax.ffi.ffi_call(WRITE_KV_TARGET, (spec, spec), input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, k.astype(k_cache.dtype), v.astype(v_cache.dtype),
                slot_mapping.astype(jnp.int32))


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array | int,
    *,
    sm_scale: float | None = None,
    sliding_window: int | jax.Array = 0,
    logits_soft_cap: float = 0.0,
    max_threads: int = 0,
) -> jax.Array:
    """Causal attention of ragged query tokens over a paged KV cache, on CPU.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (one dtype);
    kv_lens: int32[S]; block_tables: int32[S, max_blocks]; query_start_loc:
    int32[S + 1]; num_seqs: int32 scalar (may be traced). Returns [T, Hq, D] in
    q's dtype; rows of tokens outside the first num_seqs sequences are 0.
    Dtypes: float32, bfloat16, float16; accumulation is float32. Caches may also be
    QuantizedKV (int8 / fp8 values + scale codes, jaxserve/quantization/kv.py): the kernel
    dequantizes each cache row it reads.
    sliding_window > 0: a query at position p sees keys at p - sliding_window < pos <= p;
    an int32 operand, so it may be traced (a per-layer window scanned over layers).
    logits_soft_cap > 0: logits = cap * tanh(logits / cap) after scaling.
    max_threads > 0 caps the threads of XLA's intra-op pool this call uses (0: all of them).
    """
    register()
    quantized = isinstance(k_cache, QuantizedKV)
    if quantized != isinstance(v_cache, QuantizedKV):
        raise ValueError("k_cache and v_cache must both be quantized (QuantizedKV) or neither")
    if quantized:   # int8 / fp8 values + per-(slot, head) scale codes, read row by row
        scales = (k_cache.scale, v_cache.scale)
        k_cache, v_cache = k_cache.data, v_cache.data
    else:
        scales = (_EMPTY_SCALES, _EMPTY_SCALES)
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"want q [T, Hq, D] and caches [blocks, block_size, Hkv, D] of one "
                         f"shape; got {q.shape}, {k_cache.shape}, {v_cache.shape}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads} and head "
                         f"dims must match: q {q.shape}, cache {k_cache.shape}")
    kv_dtypes = _DTYPES + ((jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)) if quantized else ())
    if q.dtype not in _DTYPES or k_cache.dtype not in kv_dtypes or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtypes q={q.dtype}, k={k_cache.dtype}, v={v_cache.dtype}: the CPU "
                         f"kernel takes float32/bfloat16/float16 q and caches (or a QuantizedKV "
                         f"of int8 / float8_e4m3fn) with k and v alike")
    if logits_soft_cap < 0 or (isinstance(sliding_window, int) and sliding_window < 0):
        raise ValueError("sliding_window and logits_soft_cap must be >= 0 (0 = off)")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    num_seqs_arr = jnp.asarray(num_seqs, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q, k_cache, v_cache, *scales,
        kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
        query_start_loc.astype(jnp.int32), num_seqs_arr,
        jnp.asarray(sliding_window, jnp.int32).reshape(()),
        sm_scale=np.float32(scale), logits_soft_cap=np.float32(logits_soft_cap),
        max_threads=np.int64(max_threads),
    )
