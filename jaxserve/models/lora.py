"""The LoRA delta of one projection for every token of a step, inside the compiled step.

Each token carries its adapter's slot (0: the base model, whose slot is all zeros). Three
ways to compute ``delta[t] = (x[t] @ a[slot[t]]) @ b[slot[t]]`` were measured
(benchmarks/bench_lora.py, benchmarks/results/lora-cpu.json):

  "slots"   x @ every slot's A at once ([T, in] x [S, in, r] -> [T, S, r]), zero the slots a
            token does not use, then one dot over (slot, rank) with every B stacked as
            [S * r, out]. Reads each slot's weights once; costs S x the rank's flops, which
            are small next to the base layer's (S * r = 80 columns for 4 adapters of rank 16).
  "gather"  a[slot[t]] per token ([T, in, r]) then batched dots: materialises T copies of
            the weights, so it reads T x more than it computes.
  "ragged"  jax.lax.ragged_dot over tokens sorted by slot, then unsorted.

"slots" is the default: the fastest on CPU at decode and prefill sizes (576 -> 1536, five
rank-16 slots: 0.40 ms at T=64 and 1.6 ms at T=512; ragged 0.78 / 11.9 ms; gather 0.62 /
124 ms); the others stay here for the benchmark. Its cost does not depend on how many
distinct adapters a step uses. On an accelerator with many slots, ragged_dot (a grouped
matmul kernel) should win: re-measure there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("slots", "gather", "ragged")


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
               method: str = "slots") -> jax.Array:
    """x: [T, in]; a: [S, in, r]; b: [S, r, out] (scaling folded in); slots: i32[T] in [0, S).
    Returns [T, out] in x's dtype."""
    num_slots, rank = a.shape[0], a.shape[2]
    a, b = a.astype(x.dtype), b.astype(x.dtype)
    if method == "slots":
        xa = jnp.einsum("ti,sir->tsr", x, a)
        onehot = (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :])
        xa = xa * onehot.astype(x.dtype)[:, :, None]
        return jnp.dot(xa.reshape(x.shape[0], num_slots * rank),
                       b.reshape(num_slots * rank, b.shape[2]))
    if method == "gather":
        xa = jnp.einsum("ti,tir->tr", x, a[slots])
        return jnp.einsum("tr,tro->to", xa, b[slots])
    if method == "ragged":
        order = jnp.argsort(slots)
        sizes = jnp.bincount(slots, length=num_slots).astype(jnp.int32)
        xa = jax.lax.ragged_dot(x[order], a, sizes)
        y = jax.lax.ragged_dot(xa, b, sizes)
        return jnp.zeros_like(y).at[order].set(y)
    raise ValueError(f"unknown LoRA method {method!r}; choose one of {METHODS}")
