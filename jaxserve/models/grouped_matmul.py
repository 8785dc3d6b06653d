"""`grouped_matmul`: `jax.lax.ragged_dot`'s contract, with a CPU lowering that does only the
useful work.

On GPU/TPU ragged_dot lowers to a grouped GEMM. On CPU jax decomposes it into a matmul of
every row with every group's matrix, masked: G times the useful FLOPs and every group's
weights read even when it has no rows (a decode step of a 128-expert model would read all
128). The CPU branch here walks (tile of rows, group) work items instead -- only the
tiles each non-empty group overlaps, at most ceil(M / tile) + G of them -- in a loop whose
trip count is the number of items this step actually has (megablox's gmm schedule, in
plain jnp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   tile: int = 32) -> jax.Array:
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes [G] int32 →
    [M, N]: rows of group g times rhs[g]; rows past sum(group_sizes) are 0."""
    return jax.lax.platform_dependent(
        lhs, rhs, group_sizes,
        cpu=lambda a, b, g: tiled_grouped_matmul(a, b, g, tile),
        default=lambda a, b, g: jax.lax.ragged_dot(a, b, g))


def tiled_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                         tile: int = 32) -> jax.Array:
    """The CPU branch of `grouped_matmul` (same contract), on any platform."""
    rows, cols = lhs.shape[0], rhs.shape[2]
    tile = min(tile, rows)
    padded = -(-rows // tile) * tile
    lhs = jnp.pad(lhs, ((0, padded - rows), (0, 0)))
    group_sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first_tile = starts // tile
    items = jnp.where(group_sizes > 0, (ends - 1) // tile - first_tile + 1, 0)   # per group
    items_end = jnp.cumsum(items)                                               # [G]

    def work_item(item, out):
        group = jnp.searchsorted(items_end, item, side="right")   # skips empty groups
        t = first_tile[group] + item - (items_end[group] - items[group])
        row0 = t * tile
        block = jax.lax.dynamic_slice_in_dim(lhs, row0, tile)                     # [tile, K]
        weight = jax.lax.dynamic_index_in_dim(rhs, group, keepdims=False)         # [K, N]
        product = jnp.dot(block, weight, preferred_element_type=jnp.float32)
        row = row0 + jnp.arange(tile)
        mine = (row >= starts[group]) & (row < ends[group])
        current = jax.lax.dynamic_slice_in_dim(out, row0, tile)
        return jax.lax.dynamic_update_slice_in_dim(
            out, current + jnp.where(mine[:, None], product, 0.0), row0, 0)

    out = jax.lax.fori_loop(0, items_end[-1], work_item,
                            jnp.zeros((padded, cols), jnp.float32))
    return out[:rows].astype(jnp.result_type(lhs.dtype, rhs.dtype))
