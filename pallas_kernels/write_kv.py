"""Write this step's K/V into the paged cache through slot_mapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.quantization.kv import QuantizedKV, quantize_rows


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter k, v into the caches at their slots.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D], or QuantizedKV (int8 / fp8 values
    of that shape + scale codes [.., Hkv, 1]: each written row is quantized with its own
    scale, jaxserve/quantization/kv.py); k, v: [T, Hkv, D];
    slot_mapping: int32[T], slot = block_id * block_size + row, -1 = skip.
    Returns the updated (k_cache, v_cache). Inside a jitted step that donates
    the caches XLA performs the scatter in place; slots that are -1 (or
    otherwise out of range) leave the cache untouched.

    A plain XLA scatter: on CPU nothing beats it, and it fuses into the step.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    # -1 would wrap to the last slot under numpy indexing rules; send it out of
    # range instead so mode="drop" discards it.
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots).astype(jnp.int32)

    def put(cache, new):
        new = new.astype(cache.dtype)
        if (jnp.issubdtype(cache.dtype, jnp.floating) and cache.dtype.itemsize == 1
                and jax.default_backend() == "cpu"):
            # fp8 on CPU: scatter the bytes. XLA:CPU has no f8 scatter: it converts the whole
            # cache to f16 and back around each write (173 ms for two 12.6M-value caches,
            # where int8 takes 2 ms). Its bitcast-converts still copy the cache (32 ms), so
            # fp8 writes on CPU cost a pass over the cache; int8 does not.
            bits = put(jax.lax.bitcast_convert_type(cache, jnp.uint8),
                       jax.lax.bitcast_convert_type(new, jnp.uint8))
            return jax.lax.bitcast_convert_type(bits, cache.dtype)
        flat = cache.reshape(num_slots, *cache.shape[2:])
        flat = flat.at[slots].set(new, mode="drop")
        return flat.reshape(cache.shape)

    def scatter(cache, new):
        if isinstance(cache, QuantizedKV):
            # int8 / fp8: each (token, head) row quantized with its own scale, stored beside
            values, codes = quantize_rows(new, cache.data.dtype)
            return QuantizedKV(put(cache.data, values), put(cache.scale, codes))
        return put(cache, new)

    return scatter(k_cache, k), scatter(v_cache, v)
