"""Building blocks of the sampler (``sampler.py``), chosen for XLA:CPU compile time.

The sampler is compiled once per step bucket, and XLA:CPU compiles every LLVM kernel
(a loop fusion: elementwise work, gathers, per-row [S] arithmetic) as its own module,
~10-40 ms of CPU each. f32 reductions and dots go to YNNPACK instead, together with
the plain arithmetic feeding them (sub, mul, exp, min, max, abs, sign): a few ms each.
But YNN runs such chains slowly, and an [S] value or constant broadcast that two YNN
fusions share is materialized by a kernel of its own. So:

* passes over [S, V] use ``where`` forms: one LLVM kernel feeding a YNN reduction,
  the fast way at run time (a sign/min chain over [S, V] is 3-4x slower);
* small arrays ([S, blocks], [S, block], [S, candidates]) use arithmetic forms
  (``at_least``, ``one_hot``, ``choose``), which compile into the YNN reductions;
* prefix sums are dots with a constant triangular matrix (cumsum: several kernels);
* gathers (``take``) are read inside their consumer's kernel, where they fuse;
* each helper is meant to be called from ONE site (kernels are not shared).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32
_I32 = jnp.int32
MAX_BLOCK = 256                    # block width of the inverse CDF and the argmax
TOPK_BLOCK = 64                    # block width of the two-level top-k
NO_THRESHOLD = float(-np.finfo(np.float32).max)   # a finite "keep all but -inf" bound


def rows(v: jax.Array, ndim: int) -> jax.Array:
    """A per-row [S] value shaped to broadcast against an [S, ...] array of rank ndim."""
    return v.reshape(v.shape + (1,) * (ndim - 1))


# -- block views --------------------------------------------------------------------------
def block_width(vocab: int) -> int:
    """The largest power of two <= MAX_BLOCK that divides vocab (>= 32), else MAX_BLOCK
    (the vocab is then padded). A small vocab is one block."""
    if vocab <= MAX_BLOCK:
        return vocab
    block = MAX_BLOCK
    while block > 32 and vocab % block:
        block //= 2
    return block if vocab % block == 0 else MAX_BLOCK


def blocked(x: jax.Array, block: int) -> jax.Array:
    """[S, V] → [S, ceil(V/block), block]: a free reshape, or a -inf padded copy."""
    num_rows, vocab = x.shape
    pad = -vocab % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    return x.reshape(num_rows, (vocab + pad) // block, block)


# -- masks --------------------------------------------------------------------------------
def iota(n: int) -> np.ndarray:
    """[1, n] column indices as an f32 constant: YNN fusions cannot generate an iota, so a
    traced one becomes an extra kernel."""
    return np.arange(n, dtype=np.float32)[None, :]


def at_least(d: jax.Array) -> jax.Array:
    """1.0 where d >= 0 else 0.0 (d not NaN); arithmetic, for small arrays."""
    return jnp.minimum(jnp.sign(d) + 1.0, 1.0)


def above(d: jax.Array) -> jax.Array:
    """1.0 where d > 0 else 0.0; arithmetic, for small arrays."""
    return jnp.maximum(jnp.sign(d), 0.0)


def one_hot(index: jax.Array, shape: tuple[int, ...], offset: int = 0) -> jax.Array:
    """1.0 at [s, index[s] - offset] of an [S, n] shape (index: f32 [S])."""
    return 1.0 - jnp.minimum(jnp.abs(iota(shape[1]) + offset - index[:, None]), 1.0)


def kept_weights(p: jax.Array, row_max: jax.Array, inv_temp: jax.Array,
                 lo: jax.Array) -> jax.Array:
    """exp((p - row_max) * inv_temp) where x = p * inv_temp > lo, else 0: the kept
    weights of processed logits p [S, ...] (per-row [S] row_max, inv_temp, lo)."""
    it = rows(inv_temp, p.ndim)
    return jnp.where(p * it > rows(lo, p.ndim), jnp.exp((p - rows(row_max, p.ndim)) * it), 0.0)


def kept_weights_small(p: jax.Array, row_max: jax.Array, inv_temp: jax.Array,
                       lo: jax.Array) -> jax.Array:
    """``kept_weights`` as arithmetic (compiles into YNN fusions), for small arrays. The
    clamps keep -inf * 0 out and are no-ops on kept entries."""
    it = rows(inv_temp, p.ndim)
    d = jnp.maximum(p, NO_THRESHOLD) * it - rows(lo, p.ndim)
    return jnp.exp(jnp.minimum((p - rows(row_max, p.ndim)) * it, 0.0)) * above(d)


def strict_bound(bound: jax.Array) -> jax.Array:
    """The largest float below bound (x >= bound iff x > strict_bound(bound)), but at
    least NO_THRESHOLD (-inf is never kept) and never a denormal: XLA:CPU compares
    denormals as 0, so below 0.0 it is -FLT_MIN and below FLT_MIN it is 0.0."""
    tiny = float(np.finfo(np.float32).tiny)
    below = lax.nextafter(bound, jnp.full_like(bound, -jnp.inf))
    below = jnp.where(jnp.abs(below) < tiny, jnp.where(bound > 0, 0.0, -tiny), below)
    return jnp.maximum(below, NO_THRESHOLD)


# -- inverse CDF --------------------------------------------------------------------------
def prefix_sum(w: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis of [S, n], as one dot."""
    upper = np.triu(np.ones((w.shape[-1],) * 2, np.float32))   # a constant, no kernel
    return jnp.dot(w, upper, precision=lax.Precision.HIGHEST)


def choose(w: jax.Array, cum: jax.Array, target: jax.Array) -> jax.Array:
    """f32 index: the first with w > 0 whose inclusive prefix sum exceeds target, else the
    last with w > 0 (0 if none): rounding never picks a zero weight. One f32 min of
    key = i (wanted), 2n - i (other positive), 2n (zero weight)."""
    n = w.shape[-1]
    positive = jnp.sign(w)
    over = above(cum - target[:, None])
    best = jnp.min(positive * ((2.0 * over - 1.0) * iota(n) + (1.0 - over) * (2 * n))
                   + (1.0 - positive) * (2 * n), -1)
    return jnp.where(best < n, best, jnp.minimum(2 * n - best, n - 1))


def pick(xb: jax.Array, weight_fn, small_weight_fn, uniform_fn):
    """Index j of the flattened blocks xb [S, N, B] with probability w[j] / sum(w), where
    w = weight_fn(blocks) is elementwise (fused: never materialized), from one uniform
    per row (``uniform_fn()``, computed where it is used: no kernel of its own);
    small_weight_fn is the same w as arithmetic, for the one chosen [S, B] block.
    Returns (f32 index, the chosen [S, B] block, the index in it, row total of w); read
    the value as ``take(block, j)`` in the consumer's kernel (a gather fuses there)."""
    num_blocks, block = xb.shape[1:]
    sums = jnp.sum(weight_fn(xb), -1)                               # the one [S, V] pass
    cum = prefix_sum(sums)
    target = uniform_fn() * cum[:, -1]
    b = choose(sums, cum, target)
    bi = b.astype(_I32)[:, None]
    # The target within block b: target minus the mass of the blocks before it.
    inner_target = target - take(cum - sums, bi)
    values = jnp.take_along_axis(xb, bi[:, :, None], 1, mode="clip")[:, 0]
    inner = small_weight_fn(values)
    j = choose(inner, prefix_sum(inner), inner_target)
    index = jnp.clip(b * block + j, 0, num_blocks * block - 1)
    return index, values, j, cum[:, -1]


def take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[s, index[s]] of [S, n] (index: i32 [S, 1] or f32 [S]), clipped into range."""
    if index.ndim == 1:
        index = index.astype(_I32)[:, None]
    return jnp.take_along_axis(x, index, 1, mode="clip")[:, 0]


def first_max(xb: jax.Array, block_max: jax.Array, row_max: jax.Array) -> jax.Array:
    """i32 index of the first row max of the flattened blocks xb [S, N, B], given the
    block maxima [S, N]: XLA:CPU's variadic argmax is slow, f32 min/max are not."""
    def first(w):           # first index of w >= row_max (the [S, n] arrays are small)
        n = w.shape[1]
        return jnp.min(iota(n) + n * (1.0 - at_least(w - row_max[:, None])), -1)

    b = jnp.minimum(first(block_max), block_max.shape[1] - 1)
    values = jnp.take_along_axis(xb, b.astype(_I32)[:, None, None], 1, mode="clip")[:, 0]
    return (b * xb.shape[2] + jnp.minimum(first(values), xb.shape[2] - 1)).astype(_I32)


# -- exact top-k without a full sort ------------------------------------------------------
def top_k_values(x: jax.Array, k: int) -> jax.Array:
    """Exact ``lax.top_k(x, k)`` values of [S, V] (``top_k`` without the ids)."""
    return top_k(x, k)[0]


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact ``lax.top_k(x, k)`` (values, i32 ids) of [S, V], ties aside: the top k lie in
    the k blocks with the largest maxima, so only those k * block values are searched
    (the cost grows with k * block, not with V: XLA:CPU sorts a whole row slowly)."""
    num_rows, vocab = x.shape
    block = TOPK_BLOCK
    if vocab < 4 * k * block:
        return lax.top_k(x, k)
    xb = blocked(x, block)
    _, block_ids = lax.top_k(jnp.max(xb, -1), k)
    gathered = jnp.take_along_axis(xb, block_ids[:, :, None], 1, mode="clip")
    values, pos = lax.top_k(gathered.reshape(num_rows, k * block), k)
    ids = jnp.take_along_axis(block_ids, pos // block, 1, mode="clip") * block + pos % block
    return values, jnp.minimum(ids, vocab - 1).astype(_I32)


# -- threshold search ---------------------------------------------------------------------
def unsortable(key: jax.Array) -> jax.Array:
    """u32 key → f32, order-preserving: the inverse of key = bits | 0x80000000 for
    non-negative floats and ~bits for negative ones."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, _F32)


def largest_threshold(x: jax.Array, weights, target: jax.Array, run=True,
                      init_key=None) -> jax.Array:
    """Per row, the largest float T with sum(weights(x) where x >= T) >= target: with
    weights 1 and target k it is the k-th largest x. Built bit by bit from the top on
    float keys, one pass per bit; ``run`` (traced) False skips it (result meaningless).
    Keys below -inf's are NaN, where "not x < T" counts everything: still monotone.
    ``init_key``: any u32 [S] buffer to carry the key in (a copy needs no kernel)."""
    def cond(state):
        return run & (state[0] < 32)

    def body(state):
        i, key = state
        key = jnp.where(i == 0, jnp.uint32(0), key)
        probe = key | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        at_probe = jnp.sum(jnp.where(x < unsortable(probe)[:, None], 0.0, weights(x)), -1)
        return i + 1, jnp.where(at_probe >= target, probe, key)

    if init_key is None:
        init_key = jnp.zeros(x.shape[:1], jnp.uint32)
    key = lax.while_loop(cond, body, (jnp.int32(0), init_key))[1]
    found = unsortable(key)
    # XLA:CPU compares denormals as 0: the search may end on one where the answer is 0.
    return jnp.where(key < 0x007FFFFF, -jnp.inf,
                     jnp.where(jnp.abs(found) < np.finfo(np.float32).tiny, 0.0, found))


# -- per-row uniforms ---------------------------------------------------------------------
def uniforms(seeds: jax.Array, steps: jax.Array, columns: jax.Array) -> jax.Array:
    """Uniforms in [0, 1) (24-bit) from (seed, step_index, column) alone, broadcast
    together: a counter-based hash (three rounds of a 32-bit avalanche mix), not
    jax.random, whose threefry adds seconds of XLA:CPU compile time to every bucket."""
    h = _mix32(_mix32(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
               ^ (steps.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)))
    h = _mix32(h + (columns.astype(jnp.uint32) + jnp.uint32(1)) * jnp.uint32(0xC2B2AE3D))
    return (h >> 8).astype(_F32) * (1.0 / (1 << 24))


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with full avalanche ("lowbias32", C. Wellons)."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x21F0AAAD)
    x = (x ^ (x >> 15)) * jnp.uint32(0xD35A2D97)
    return x ^ (x >> 15)
