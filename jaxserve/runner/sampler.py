"""The sampler: logits of each sequence's last token → next token (+ logprobs).

A pure function called inside the engine's jitted step; shapes are static and
nothing varies per step except array values, so it never recompiles. The order
is vLLM v1's:

1. logprobs come from the RAW logits (log-softmax before any processing);
2. logit bias and min_tokens bans (additive, -inf), then repetition / frequency /
   presence penalties;
3. greedy rows take the argmax of the processed logits;
4. random rows: divide by temperature, min_p, top_k, top_p, then sample.

Cost is kept near what the batch needs: every optional stage sits behind a
``lax.cond`` on "does any row need it", so an all-greedy batch costs about one
argmax. Random rows sample by inverse CDF with ONE uniform per row, a hash of
(seed, step_index): a request's sample depends only on its own row, never on
its position or neighbours. The kept set of min_p / top_k / top_p
is always "every token whose scaled logit is >= a per-row threshold"; top_k and
top_p thresholds come from the exact top ``num_candidates`` logits (two-level
block top-k, no full sort: XLA's CPU sort takes ~1 s at [64, 49152]). Rows whose
top-p nucleus is larger than the candidates sample by rejection with a rising
pivot (exact, one pass per round; see ``_sample_nucleus_by_rejection``), and rows
with top_k > num_candidates find the k-th logit by bisection on float bits (32
passes: slow, but only when such a row is in the batch).

CPU notes (measured, XLA:CPU): reductions of f32 are fast, variadic ones (argmax)
and integer sums are not, so argmax goes through block maxima and counts are f32
sums; nothing [S, V] is materialized on the common paths, since XLA mallocs every
temporary on every call and glibc page-faults large ones in again each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runner.sampling_tensors import SamplingTensors

__all__ = ["SamplerOutput", "SamplingTensors", "sample", "process_logits", "sampling_probs"]

GREEDY_EPS = 1e-5
_CDF_BLOCK = 256            # inverse-CDF block width (block sums, then one block's cumsum)
_ARGMAX_BLOCK = 256         # block width of the two-level argmax
_TOPK_BLOCK = 64            # block width of the two-level top-k
_MAX_REJECTION_ROUNDS = 32  # guard against NaN logits; normal rows finish in a few rounds
_F32 = jnp.float32
_I32 = jnp.int32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """Per row. Logprob fields are log-softmax of the RAW logits; they are computed when
    any row has num_logprobs >= 0 (top ones when any row has num_logprobs > 0) and are
    zeros otherwise."""

    next_tokens: jax.Array       # i32[S]
    sampled_logprobs: jax.Array  # f32[S], logprob of next_tokens
    sampled_ranks: jax.Array     # i32[S], tokens with logprob >= it (vLLM's rank, 1=best)
    top_token_ids: jax.Array     # i32[S, K], K = num_top_logprobs, by logprob descending
    top_logprobs: jax.Array      # f32[S, K]


def sample(logits: jax.Array, t: SamplingTensors, num_top_logprobs: int, *,
           num_candidates: int = 64) -> SamplerOutput:
    """Sample one token per row. logits: [S, V]; ``num_top_logprobs`` (K) is static."""
    logits = logits.astype(_F32)
    num_rows = logits.shape[0]
    processed = process_logits(logits, t)
    is_greedy = t.temperature < GREEDY_EPS
    greedy = lax.cond(jnp.any(is_greedy), _argmax, _zero_tokens, processed)
    random = lax.cond(jnp.any(~is_greedy), partial(_sample_random, num_candidates=num_candidates),
                      lambda p, t: _zero_tokens(p), processed, t)
    tokens = jnp.where(is_greedy, greedy, random)
    sampled_logprobs, ranks, lse = lax.cond(
        jnp.any(t.num_logprobs >= 0), _chosen_logprobs,
        lambda lg, tok: (jnp.zeros(num_rows, _F32), jnp.zeros(num_rows, _I32),
                         jnp.zeros(num_rows, _F32)),
        logits, tokens)
    k = num_top_logprobs
    if k == 0:
        top_ids, top_lp = jnp.zeros((num_rows, 0), _I32), jnp.zeros((num_rows, 0), _F32)
    else:
        top_ids, top_lp = lax.cond(
            jnp.any(t.num_logprobs > 0), partial(_top_logprobs, k=k),
            lambda lg, lse: (jnp.zeros((num_rows, k), _I32), jnp.zeros((num_rows, k), _F32)),
            logits, lse)
    return SamplerOutput(tokens, sampled_logprobs, ranks, top_ids, top_lp)


# -- stage 2: bias, bans and penalties ----------------------------------------------------
def process_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Logit bias / min_tokens bans, then vLLM's penalties. [S, V] → [S, V]."""
    needs_bias = jnp.any(t.bias_token_ids >= 0)
    needs_penalties = jnp.any((t.repetition_penalty != 1.0) | (t.frequency_penalty != 0.0)
                              | (t.presence_penalty != 0.0))

    def apply(logits: jax.Array) -> jax.Array:
        logits = lax.cond(needs_bias, _apply_bias, lambda lg, t: lg, logits, t)
        return lax.cond(needs_penalties, _apply_penalties, lambda lg, t: lg, logits, t)

    # One outer cond: an untaken cond still copies [S, V] (the raw logits stay live for
    # the logprobs), so the common "nothing to do" case pays for one copy, not two.
    return lax.cond(needs_bias | needs_penalties, apply, lambda lg: lg, logits)


def _apply_bias(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    num_rows, vocab = logits.shape
    ids = t.bias_token_ids
    cols = jnp.where((ids >= 0) & (ids < vocab), ids, vocab)   # vocab = out of range: dropped
    rows = lax.broadcasted_iota(_I32, ids.shape, 0)
    return logits.at[rows, cols].add(t.bias_values, mode="drop")


def _apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM: repetition over prompt+output tokens; frequency/presence over output tokens."""
    num_rows, vocab = logits.shape
    ids = t.penalty_token_ids
    is_output = lax.broadcasted_iota(_I32, ids.shape, 1) >= t.num_prompt_tokens[:, None]
    # One scatter counts both: prompt tokens in columns [0, V), output tokens in [V, 2V).
    cols = jnp.where((ids >= 0) & (ids < vocab), ids + jnp.where(is_output, vocab, 0),
                     2 * vocab)
    rows = lax.broadcasted_iota(_I32, ids.shape, 0)
    counts = jnp.zeros((num_rows, 2 * vocab), _I32).at[rows, cols].add(1, mode="drop")
    output_counts = counts[:, vocab:]
    seen = (counts[:, :vocab] > 0) | (output_counts > 0)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * output_counts.astype(_F32)
    return logits - t.presence_penalty[:, None] * (output_counts > 0).astype(_F32)


# -- stage 4: random rows -----------------------------------------------------------------
def _inverse_temperature(t: SamplingTensors) -> jax.Array:
    return 1.0 / jnp.where(t.temperature < GREEDY_EPS, 1.0, t.temperature)


def _rows(v: jax.Array, ndim: int) -> jax.Array:
    """A per-row [S] value shaped to broadcast against an [S, ...] array of rank ndim."""
    return v.reshape(v.shape + (1,) * (ndim - 1))


def _scale(processed: jax.Array, t: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits x (greedy rows unscaled); fuses into its consumers. Any
    [S, ...] reshaping of processed works, so blocks of it scale identically."""
    return processed * _rows(_inverse_temperature(t), processed.ndim)


def _max_and_min_p_threshold(processed: jax.Array, t: SamplingTensors):
    """Row max of x (= max of processed, scaled: scaling is monotone) and the min_p
    threshold: vLLM keeps p >= min_p * p_max, i.e. x >= m + log(min_p)."""
    m = jnp.max(processed, -1) * _inverse_temperature(t)
    return m, m + jnp.where(t.min_p > 0, jnp.log(t.min_p), -jnp.inf)


def _kept_weights(x: jax.Array, m: jax.Array, threshold: jax.Array) -> jax.Array:
    """exp(x - m) where x >= threshold, else 0: the unnormalized kept distribution."""
    return jnp.where(x >= _rows(threshold, x.ndim), jnp.exp(x - _rows(m, x.ndim)), 0.0)


def _filter_flags(t: SamplingTensors, vocab: int):
    random_rows = t.temperature >= GREEDY_EPS
    top_k_on = random_rows & (t.top_k > 0) & (t.top_k < vocab)
    top_p_on = random_rows & (t.top_p < 1.0)
    return top_k_on, top_p_on


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Thresholds:
    threshold: jax.Array        # f32[S]: keep x >= this (exact where resolved)
    top_k_threshold: jax.Array  # f32[S]: min_p and top_k only
    nucleus_mass: jax.Array     # f32[S]: top_p * mass kept by min_p and top_k
    resolved: jax.Array         # bool[S]: False = nucleus extends past the candidates


def _sample_random(processed: jax.Array, t: SamplingTensors, num_candidates: int) -> jax.Array:
    """Tokens of the random rows (greedy rows get a value that the caller discards)."""
    m, min_p_threshold = _max_and_min_p_threshold(processed, t)
    top_k_on, top_p_on = _filter_flags(t, processed.shape[1])
    u = _uniforms(t, 1 + _MAX_REJECTION_ROUNDS)            # [S, R]: column r for round r
    # The conds carry only [S] results: no [S, V] array is copied through them.
    f = lax.cond(jnp.any(top_k_on | top_p_on),
                 partial(_thresholds, num_candidates=num_candidates),
                 lambda processed, t, m, min_p_threshold: _Thresholds(
                     min_p_threshold, min_p_threshold, jnp.zeros_like(m), jnp.ones(m.shape, bool)),
                 processed, t, m, min_p_threshold)
    tokens = _inverse_cdf(
        (processed,), lambda p: _kept_weights(_scale(p, t), m, f.threshold), u[:, 0])
    return lax.cond(jnp.any(~f.resolved), _sample_nucleus_by_rejection,
                    lambda processed, t, m, f, u, tokens: tokens, processed, t, m, f, u, tokens)


def _thresholds(processed: jax.Array, t: SamplingTensors, m: jax.Array,
                min_p_threshold: jax.Array, num_candidates: int) -> _Thresholds:
    """Per-row keep thresholds for min_p, then top_k, then top_p (vLLM's order)."""
    vocab = processed.shape[1]
    top_k_on, top_p_on = _filter_flags(t, vocab)
    cand, _ = _top_k_values(processed, min(num_candidates, vocab))
    cand = _scale(cand, t)                                  # [S, C] x values, descending
    num_cand = cand.shape[1]
    small_k = top_k_on & (t.top_k <= num_cand)
    kth = jnp.take_along_axis(cand, jnp.clip(t.top_k - 1, 0, num_cand - 1)[:, None], 1)[:, 0]
    big_k = top_k_on & ~small_k
    # Rare paths get `processed` (an existing buffer) and recompute x: a cond that holds a
    # loop and captures a fresh [S, V] temporary costs far more on CPU, even untaken.
    kth = lax.cond(jnp.any(big_k), _kth_largest_of_rows, lambda processed, t, big_k, kth: kth,
                   processed, t, big_k, kth)
    top_k_threshold = jnp.maximum(min_p_threshold, jnp.where(top_k_on, kth, -jnp.inf))
    # top_p renormalizes over what min_p and top_k kept (vLLM masks before its softmax).
    cand_e = _kept_weights(cand, m, top_k_threshold)
    mass = jnp.where(small_k, jnp.sum(cand_e, -1), lax.cond(
        jnp.any(top_p_on & ~small_k),
        lambda processed, t, m, thr: jnp.sum(_kept_weights(_scale(processed, t), m, thr), -1),
        lambda processed, t, m, thr: jnp.zeros_like(m),
        processed, t, m, top_k_threshold))
    nucleus_mass = t.top_p * mass
    # Token j (descending order) is in the nucleus iff the mass strictly above it < p * mass.
    cum = _prefix_sum(cand_e)
    above = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], -1)
    num_keep = jnp.sum(above < nucleus_mass[:, None], -1)
    top_p_threshold = jnp.take_along_axis(cand, jnp.maximum(num_keep - 1, 0)[:, None], 1)[:, 0]
    threshold = jnp.maximum(top_k_threshold, jnp.where(top_p_on, top_p_threshold, -jnp.inf))
    resolved = ~top_p_on | small_k | (cum[:, -1] >= nucleus_mass)
    return _Thresholds(threshold, top_k_threshold, nucleus_mass, resolved)


def _sample_nucleus_by_rejection(processed: jax.Array, t: SamplingTensors, m: jax.Array,
                                 f: _Thresholds, u: jax.Array, tokens: jax.Array) -> jax.Array:
    """Exact top-p sampling without a sort, for the rows whose nucleus is not resolved.

    Sample from the kept tokens above a pivot; accept if the token is in the nucleus
    (mass strictly above it < nucleus_mass), else raise the pivot to it. The nucleus is
    a top prefix and always lies above the pivot, so an accepted token is distributed as
    the renormalized nucleus. The block sums above a candidate both decide its acceptance
    and are the next proposal's distribution, so a round is one pass over [S, V]. Nothing
    [S, V] is materialized (XLA:CPU mallocs every temporary on every call).
    """
    blocked = _blocked((processed,))

    def weights_above(pivot):
        def weights(p):
            x = _scale(p, t)
            kept = _kept_weights(x, m, f.top_k_threshold)
            return jnp.where(x > _rows(pivot, x.ndim), kept, 0.0)
        return weights

    def cond(state):
        round_, done = state[0], state[3]
        return jnp.any(~done) & (round_ <= _MAX_REJECTION_ROUNDS)

    def body(state):
        # Round 1 proposes from all kept tokens; each later round judges the previous
        # proposal with the block sums above it, which are also the next proposal's.
        round_, candidate, has_candidate, done, tokens = state
        value = _scale(jnp.take_along_axis(processed, candidate[:, None], 1)[:, 0], t)
        pivot = jnp.where(has_candidate, value, -jnp.inf)
        sums = _block_sums(blocked, weights_above(pivot))
        accept = has_candidate & ~done & (jnp.sum(sums, -1) < f.nucleus_mass)
        column = jnp.minimum(round_, _MAX_REJECTION_ROUNDS)
        proposal = _pick(blocked, sums, weights_above(pivot), u[:, column])
        tokens = jnp.where(accept, candidate, tokens)
        candidate = jnp.where(done | accept, candidate, proposal)
        return round_ + 1, candidate, jnp.ones_like(done), done | accept, tokens

    # Rows still undone after the cap (NaN logits) keep their candidate-threshold token.
    init = (jnp.int32(1), tokens, jnp.zeros_like(f.resolved), f.resolved, tokens)
    return lax.while_loop(cond, body, init)[4]


def _inverse_cdf(arrays: tuple[jax.Array, ...], weight_fn, u: jax.Array) -> jax.Array:
    """Index j with probability w[j] / sum(w), from one uniform u per row.

    w = weight_fn(*arrays), elementwise and shape-agnostic (arrays: [S, V] each). Two
    levels: block sums of w (fused: w is never materialized), then the cumsum of the one
    chosen block, recomputed from the arrays. A token with zero weight is never returned
    (unless the whole row is zero).
    """
    blocked = _blocked(arrays)
    return _pick(blocked, _block_sums(blocked, weight_fn), weight_fn, u)


def _blocked(arrays: tuple[jax.Array, ...]):
    """([S, V/B, B] views of the arrays, [S, V % B] tails or None). No copy of [S, V]."""
    num_rows, vocab = arrays[0].shape
    block = _cdf_block(vocab)
    num_blocks = vocab // block
    main = tuple(a[:, :num_blocks * block].reshape(num_rows, num_blocks, block)
                 for a in arrays)
    tail = tuple(a[:, num_blocks * block:] for a in arrays) if vocab % block else None
    return main, tail


def _cdf_block(vocab: int) -> int:
    """The largest power of two <= _CDF_BLOCK dividing vocab if >= 32 (no tail), else
    _CDF_BLOCK (plus a tail); a small vocab is one block."""
    if vocab <= _CDF_BLOCK:
        return vocab
    block = _CDF_BLOCK
    while block > 32 and vocab % block:
        block //= 2
    return block if vocab % block == 0 else _CDF_BLOCK


def _block_sums(blocked, weight_fn) -> jax.Array:
    main, tail = blocked
    sums = jnp.sum(weight_fn(*main), -1)
    if tail is not None:
        sums = jnp.concatenate([sums, jnp.sum(weight_fn(*tail), -1, keepdims=True)], -1)
    return sums


def _pick(blocked, block_sums: jax.Array, weight_fn, u: jax.Array) -> jax.Array:
    """The token at u * total in the CDF whose block sums are given."""
    main, tail = blocked
    num_main, block = main[0].shape[1:]
    block_cum = _prefix_sum(block_sums)
    target = u * block_cum[:, -1]
    b = _positive_near(block_sums, jnp.sum(block_cum <= target[:, None], -1))
    before = jnp.where(b > 0, jnp.take_along_axis(block_cum, jnp.maximum(b - 1, 0)[:, None],
                                                  1)[:, 0], 0.0)
    in_main = jnp.minimum(b, num_main - 1)[:, None, None]
    inner = weight_fn(*(jnp.take_along_axis(a, in_main, 1) for a in main))[:, 0]
    if tail is not None:
        tail_weights = weight_fn(*tail)
        tail_weights = jnp.pad(tail_weights, ((0, 0), (0, block - tail_weights.shape[1])))
        inner = jnp.where((b == num_main)[:, None], tail_weights, inner)
    j = jnp.sum(_prefix_sum(inner) <= (target - before)[:, None], -1)
    return (b * block + _positive_near(inner, j)).astype(_I32)


def _prefix_sum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis in log2(n) shifted adds (jnp.cumsum's
    scan costs far more compile time). Like any float scan it may be non-monotone by a
    rounding error, which ``_positive_near`` absorbs."""
    n, shift = x.shape[-1], 1
    while shift < n:
        x = x + jnp.pad(x[:, :-shift], ((0, 0), (shift, 0)))
        shift *= 2
    return x


def _positive_near(w: jax.Array, index: jax.Array) -> jax.Array:
    """index (clamped into range) if w[index] > 0, else the nearest positive entry below
    it, else above it: a rounding error in the CDF never picks a zero-weight token."""
    iota = lax.broadcasted_iota(_I32, w.shape, 1)
    index = jnp.minimum(index, w.shape[1] - 1)[:, None]
    positive = w > 0
    below = jnp.max(jnp.where(positive & (iota <= index), iota, -1), -1)
    above = jnp.min(jnp.where(positive & (iota > index), iota, w.shape[1] - 1), -1)
    return jnp.where(below >= 0, below, above)


def _uniforms(t: SamplingTensors, n: int) -> jax.Array:
    """[S, n] uniforms in [0, 1) (24-bit) from (seed, step_index, column) alone.

    A counter-based hash (three rounds of a 32-bit avalanche mix), not jax.random:
    threefry adds ~1.5 s of XLA:CPU compile time to every sequence bucket.
    """
    seeds = t.seeds.astype(jnp.uint32)
    steps = t.step_index.astype(jnp.uint32)
    columns = lax.broadcasted_iota(jnp.uint32, (seeds.shape[0], n), 1)
    h = _mix32(_mix32(seeds ^ jnp.uint32(0x9E3779B9)) ^ (steps * jnp.uint32(0x85EBCA77)))
    h = _mix32(h[:, None] + (columns + jnp.uint32(1)) * jnp.uint32(0xC2B2AE3D))
    return (h >> 8).astype(_F32) * (1.0 / (1 << 24))


def _mix32(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with full avalanche ("lowbias32", C. Wellons)."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x21F0AAAD)
    x = (x ^ (x >> 15)) * jnp.uint32(0xD35A2D97)
    return x ^ (x >> 15)


# -- exact top-k without a full sort ------------------------------------------------------
def _top_k_values(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact ``lax.top_k(x, k)`` values and indices: the top k lie in the k blocks with
    the largest maxima, so only those k * block elements are searched (a vocab that
    blocks do not divide has its tail as one more, -inf padded, block: no [S, V] copy)."""
    num_rows, vocab = x.shape
    block = _TOPK_BLOCK
    if vocab < 4 * k * block:
        return lax.top_k(x, k)
    num_main = vocab // block
    main = x[:, :num_main * block].reshape(num_rows, num_main, block)
    block_max = jnp.max(main, -1)
    if vocab % block:
        tail = jnp.pad(x[:, num_main * block:], ((0, 0), (0, block - vocab % block)),
                       constant_values=-jnp.inf)
        block_max = jnp.concatenate([block_max, jnp.max(tail, -1, keepdims=True)], -1)
    _, block_ids = lax.top_k(block_max, k)
    gathered = jnp.take_along_axis(main, jnp.minimum(block_ids, num_main - 1)[:, :, None], 1)
    if vocab % block:
        gathered = jnp.where((block_ids == num_main)[:, :, None], tail[:, None, :], gathered)
    values, pos = lax.top_k(gathered.reshape(num_rows, k * block), k)
    ids = jnp.take_along_axis(block_ids, pos // block, 1) * block + pos % block
    return values, ids.astype(_I32)


def _sortable(x: jax.Array) -> jax.Array:
    """f32 → u32 with the same order (for bisection over float bits)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, _F32)


def _bisect_u32(predicate, num_rows: int) -> jax.Array:
    """Per row, the largest u32 T with predicate(T) true (predicate(0) must hold and be
    monotone: true up to T, false after). 32 passes."""
    def body(_, bounds):
        lo, hi = bounds
        span = hi - lo
        mid = lo + (span >> 1) + (span & 1)
        ok = predicate(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros(num_rows, jnp.uint32)
    hi = jnp.full(num_rows, 0xFFFFFFFF, jnp.uint32)
    return lax.fori_loop(0, 32, body, (lo, hi))[0]


def _kth_largest_of_rows(processed: jax.Array, t: SamplingTensors, rows: jax.Array,
                         fallback: jax.Array) -> jax.Array:
    """The top_k-th largest scaled logit of the given rows (else ``fallback``), by bisection
    over float bits: 32 count passes, for top_k beyond the candidates."""
    def count_at_least(mid):
        keys = _sortable(_scale(processed, t))
        # Counting in f32 (exact below 2**24) keeps the fast reduction path on CPU.
        return jnp.sum(jnp.where(keys >= mid[:, None], 1.0, 0.0), -1) >= t.top_k

    return jnp.where(rows, _unsortable(_bisect_u32(count_at_least, processed.shape[0])),
                     fallback)


# -- greedy and logprobs ------------------------------------------------------------------
def _argmax(logits: jax.Array) -> jax.Array:
    """First index of the row max. Two levels (block maxima, then one block): XLA's CPU
    argmax is a slow variadic reduce, a plain max is several times faster."""
    num_rows, vocab = logits.shape
    block = _ARGMAX_BLOCK
    num_blocks = vocab // block
    if num_blocks < 2:
        return jnp.argmax(logits, -1).astype(_I32)
    main = logits[:, :num_blocks * block].reshape(num_rows, num_blocks, block)
    block_max = jnp.max(main, -1)
    best_block = jnp.argmax(block_max, -1)
    inner = jnp.take_along_axis(main, best_block[:, None, None], 1)[:, 0]
    index = best_block * block + jnp.argmax(inner, -1)
    if num_blocks * block < vocab:                  # the tail that does not fill a block
        tail = logits[:, num_blocks * block:]
        in_tail = jnp.max(tail, -1) > jnp.max(block_max, -1)
        index = jnp.where(in_tail, num_blocks * block + jnp.argmax(tail, -1), index)
    return index.astype(_I32)


def _zero_tokens(logits: jax.Array) -> jax.Array:
    return jnp.zeros(logits.shape[:1], _I32)


def _chosen_logprobs(logits: jax.Array, tokens: jax.Array):
    m = jnp.max(logits, -1)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), -1))
    chosen = jnp.take_along_axis(logits, tokens[:, None], 1)
    # vLLM: ties count as ahead. Counting in f32 keeps the fast reduction path on CPU.
    ranks = jnp.sum(jnp.where(logits >= chosen, 1.0, 0.0), -1).astype(_I32)
    return chosen[:, 0] - lse, ranks, lse


def _top_logprobs(logits: jax.Array, lse: jax.Array, k: int):
    values, ids = _top_k_values(logits, min(k, logits.shape[1]))
    if values.shape[1] < k:                                   # vocab smaller than K
        pad = k - values.shape[1]
        values = jnp.pad(values, ((0, 0), (0, pad)), constant_values=-jnp.inf)
        ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=0)
    return ids.astype(_I32), values - lse[:, None]


# -- for tests and notebooks --------------------------------------------------------------
def sampling_probs(logits: jax.Array, t: SamplingTensors, *,
                   num_candidates: int = 64) -> jax.Array:
    """The distribution each random row samples from: [S, V], rows sum to 1.

    Same thresholds as ``sample``; where the nucleus is larger than the candidates
    (``sample`` uses rejection there) the top-p threshold is found by bisection.
    """
    processed = process_logits(logits.astype(_F32), t)
    m, min_p_threshold = _max_and_min_p_threshold(processed, t)
    f = _thresholds(processed, t, m, min_p_threshold, num_candidates)
    x = _scale(processed, t)
    weights = _kept_weights(x, m, f.top_k_threshold)
    keys = _sortable(x)
    # Smallest key whose strictly-above mass is < nucleus_mass = 1 + largest failing key.
    last_out = _bisect_u32(
        lambda mid: jnp.sum(jnp.where(keys > mid[:, None], weights, 0.0), -1)
        >= f.nucleus_mass, x.shape[0])
    exact = jnp.maximum(f.top_k_threshold, _unsortable(last_out + 1))
    w = _kept_weights(x, m, jnp.where(f.resolved, f.threshold, exact))
    return w / jnp.sum(w, -1, keepdims=True)
