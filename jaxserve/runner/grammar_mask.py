"""Structured outputs inside the jitted step: a packed token bitmask → -inf logits.

The bitmask is xgrammar's layout: i32[S, ceil(V / 32)], bit ``v % 32`` of word ``v // 32``
set when token v is allowed. Rows without a grammar (and padding rows) are all ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits f32[S, V], bitmask i32[S, ceil(V/32)] → logits with disallowed tokens at -inf.

    Behind a cond on "any word is not all ones": a step with no constrained row pays one
    pass over the small bitmask, not an [S, V] select.
    """
    num_rows, vocab = logits.shape

    def mask(logits: jax.Array) -> jax.Array:
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = (bitmask[:, :, None] >> shifts) & 1                  # [S, W, 32]
        allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
        return jnp.where(allowed, logits, -jnp.inf)

    return lax.cond(jnp.any(bitmask != -1), mask, lambda logits: logits, logits)
