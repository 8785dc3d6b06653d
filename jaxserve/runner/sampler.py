"""The sampler: logits of each sequence's last token → next token (+ logprobs).

A pure function called inside the engine's jitted step; shapes are static and
nothing varies per step except array values, so it never recompiles. The order
is vLLM v1's:

1. logprobs come from the RAW logits (log-softmax before any processing, and before the
   structured-outputs grammar mask, as vLLM's default ``logprobs_mode="raw_logprobs"``);
2. the grammar bitmask (structured outputs) sets disallowed tokens to -inf; then logit
   bias and min_tokens bans (additive, -inf), then repetition / frequency / presence
   penalties;
3. greedy rows take the argmax of the processed logits;
4. random rows: divide by temperature, min_p, top_k, top_p, then sample.

It is compiled once per step bucket, so it is built for XLA:CPU compile time as much
as for run time (see ``sampling_ops``): few kernels, each at one call site. Optional
stages sit behind a ``lax.cond`` on "does any row need it"; an all-greedy batch costs
one block-max pass.

Sampling has ONE site, a loop that every other batch runs (greedy rows ride along as
"the first token at the row max"). Each round is one pass over the logits: block sums
of the kept weights exp(x - max) above a per-row bound, then an inverse-CDF pick from
one uniform per row, a hash of (seed, step_index, round): a request's sample depends
only on its own row. min_p and top_k set the bound (top_k from the exact top
``num_candidates`` logits, two-level block top-k, or by bisection when top_k is
larger); rows without top_p accept round 0's pick. top_p is exact rejection sampling
without a sort: round 0's total times top_p is the nucleus mass; a proposal is in the
nucleus iff the kept mass strictly above it is below that, which is the next round's
total, since the next round proposes from the tokens strictly above the pending
proposal. The nucleus is a top prefix and always lies above the pending proposal, so
accepted tokens follow the renormalized nucleus exactly (~2-4 rounds per batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.runner import sampling_ops as ops
from jaxserve.runner.grammar_mask import apply_token_bitmask
from jaxserve.runner.penalty_state import PenaltyHistory
from jaxserve.runner.sampling_tensors import SamplingTensors

__all__ = ["SamplerOutput", "SamplingTensors", "process_logits", "sample", "sampling_probs"]

GREEDY_EPS = 1e-5
_MAX_ROUNDS = 32    # guard against NaN logits; normal rows finish in a few rounds
_F32 = jnp.float32
_I32 = jnp.int32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """Per row. Logprob fields are log-softmax of the RAW logits, computed when any row
    has num_logprobs >= 0, zeros otherwise."""

    next_tokens: jax.Array       # i32[S]
    sampled_logprobs: jax.Array  # f32[S], logprob of next_tokens
    sampled_ranks: jax.Array     # i32[S], tokens with logprob >= it (vLLM's rank, 1=best)
    top_token_ids: jax.Array     # i32[S, K], K = num_top_logprobs, by logprob descending
    top_logprobs: jax.Array      # f32[S, K]


def sample(logits: jax.Array, t: SamplingTensors, num_top_logprobs: int, *,
           num_candidates: int = 64, grammar_bitmask: jax.Array | None = None,
           penalty_history: PenaltyHistory | None = None) -> SamplerOutput:
    """Sample one token per row. logits: [S, V]; ``num_top_logprobs`` (K) is static.
    grammar_bitmask: i32[S, ceil(V/32)] of allowed tokens (structured outputs), or None.
    penalty_history: the device-resident history, added to ``t``'s token ids (or None)."""
    logits = logits.astype(_F32)
    num_rows, vocab = logits.shape
    k = num_top_logprobs
    need = _needs(t, vocab, num_candidates)
    allowed = logits if grammar_bitmask is None else apply_token_bitmask(logits,
                                                                         grammar_bitmask)
    processed = process_logits(allowed, t, need(_PROCESS), penalty_history)
    xb = ops.blocked(processed, ops.block_width(vocab))      # [S, V/B, B] view
    block_max = jnp.max(xb, -1)
    row_max = jnp.max(block_max, -1)
    tokens = lax.cond(need(_RANDOM),
                      partial(_sample_rows, vocab=vocab, num_candidates=num_candidates),
                      lambda xb, bm, rm, t, need_bits: ops.first_max(xb, bm, rm),
                      xb, block_max, row_max, t, need.bits)
    logprobs = lax.cond(
        need(_LOGPROBS), partial(_logprobs, k=k),
        lambda lg, tok: (jnp.zeros(num_rows, _F32), jnp.zeros(num_rows, _I32),
                         jnp.zeros((num_rows, k), _I32), jnp.zeros((num_rows, k), _F32)),
        logits, tokens)
    return SamplerOutput(tokens, *logprobs)


# Bits of "does any row need it", one OR-reduction for every cond: a reduction over rows
# costs two LLVM kernels, a bit test one.
_PROCESS, _RANDOM, _LOGPROBS, _TOP_K, _BIG_K = (1 << i for i in range(5))


class _Need:
    def __init__(self, bits: jax.Array):
        self.bits = bits

    def __call__(self, bit: int) -> jax.Array:
        return (self.bits & bit) != 0


def _needs(t: SamplingTensors, vocab: int, num_candidates: int) -> _Need:
    random = t.temperature >= GREEDY_EPS
    top_k_on = random & (t.top_k > 0) & (t.top_k < vocab)
    bits = jnp.where(_needs_processing(t), _PROCESS, 0) | jnp.where(random, _RANDOM, 0) \
        | jnp.where(t.num_logprobs >= 0, _LOGPROBS, 0) | jnp.where(top_k_on, _TOP_K, 0) \
        | jnp.where(top_k_on & (t.top_k > min(num_candidates, vocab)), _BIG_K, 0)
    return _Need(lax.reduce(bits, np.int32(0), lax.bitwise_or, (0,)))


def _needs_processing(t: SamplingTensors) -> jax.Array:
    """Per row: any logit bias / ban (a zero bias is a no-op) or penalty."""
    return (jnp.max(jnp.abs(t.bias_values), -1) > 0) | (
        jnp.abs(t.repetition_penalty - 1.0) + jnp.abs(t.frequency_penalty)
        + jnp.abs(t.presence_penalty) > 0)


# -- stage 2: bias, bans and penalties ----------------------------------------------------
def process_logits(logits: jax.Array, t: SamplingTensors, needed=None,
                   penalty_history: PenaltyHistory | None = None) -> jax.Array:
    """Logit bias / min_tokens bans, then vLLM's penalties. [S, V] → [S, V]. ``needed``:
    whether any row needs it (computed if None). The history's tables are read only when
    it is (inside the cond: an unpenalized step gathers nothing)."""
    if needed is None:
        needed = jnp.any(_needs_processing(t))
    return lax.cond(needed, _apply_bias_and_penalties, lambda lg, t, h: lg, logits, t,
                    penalty_history)


def _apply_bias_and_penalties(logits: jax.Array, t: SamplingTensors,
                              history: PenaltyHistory | None) -> jax.Array:
    """One scatter-add into [S, 3V]: bias values in [0, V), prompt-token counts in
    [V, 2V), output-token counts in [2V, 3V); plus the device-resident history's rows.
    vLLM: repetition over prompt+output tokens, frequency/presence over output tokens, all
    after the bias."""
    num_rows, vocab = logits.shape
    num_bias = t.bias_token_ids.shape[1]
    # The newest token (when the host did not know it) goes last: past any prompt position,
    # so it counts as an output token.
    # newest_token_ids: [S], or [S, n] (speculative verification: the newest token, then
    # the drafts before the position).
    ids = jnp.concatenate([t.bias_token_ids, t.penalty_token_ids,
                           t.newest_token_ids.reshape(num_rows, -1)], 1)
    column = lax.broadcasted_iota(_I32, ids.shape, 1)
    offset = jnp.where(column < num_bias, 0, jnp.where(
        column - num_bias < t.num_prompt_tokens[:, None], vocab, 2 * vocab))
    cols = jnp.where((ids >= 0) & (ids < vocab), ids + offset, 3 * vocab)
    updates = jnp.concatenate(
        [t.bias_values, jnp.ones((num_rows, ids.shape[1] - num_bias), _F32)], 1)
    row = lax.broadcasted_iota(_I32, ids.shape, 0)
    acc = jnp.zeros((num_rows, 3 * vocab), _F32).at[row, cols].add(updates, mode="drop")
    logits = logits + acc[:, :vocab]
    output_counts = acc[:, 2 * vocab:]
    prompt_seen = acc[:, vocab:2 * vocab] > 0
    if history is not None:
        table_counts, table_seen = history.gather()
        output_counts = output_counts + table_counts
        prompt_seen = prompt_seen | table_seen
    seen = prompt_seen | (output_counts > 0)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * (output_counts > 0).astype(_F32)


# -- stage 4: random rows -----------------------------------------------------------------
def _keep_bound(xb: jax.Array, row_max: jax.Array, t: SamplingTensors, vocab: int,
                num_candidates: int, need: _Need):
    """(inv_temp, x_max, lo): x = processed * inv_temp, its row max, and the min_p and
    top_k bound, keep x > lo (greedy rows: the row max only)."""
    greedy = t.temperature < GREEDY_EPS
    inv_temp = 1.0 / jnp.where(greedy, 1.0, t.temperature)
    x_max = row_max * inv_temp
    top_k_on = ~greedy & (t.top_k > 0) & (t.top_k < vocab)
    # Untaken: any [S] buffer (a copy, no kernel); no row reads it.
    kth = lax.cond(need(_TOP_K),
                   partial(_kth_largest, vocab=vocab, num_candidates=num_candidates),
                   lambda xb, rm, t, big: rm, xb, row_max, t, need(_BIG_K))
    bound = jnp.maximum(jnp.where(top_k_on, kth * inv_temp, ops.NO_THRESHOLD),
                        jnp.where(~greedy & (t.min_p > 0), x_max + jnp.log(t.min_p),
                                  ops.NO_THRESHOLD))
    return inv_temp, x_max, ops.strict_bound(jnp.where(greedy, x_max, bound))


def _kth_largest(xb: jax.Array, row_max: jax.Array, t: SamplingTensors, any_big: jax.Array,
                 vocab: int, num_candidates: int) -> jax.Array:
    """The top_k-th largest processed logit of each row: from the exact top candidates,
    or by bisection (32 count passes, run only if some row's top_k exceeds them)."""
    processed = xb.reshape(xb.shape[0], -1)    # -inf padding moves no k-th value > -inf
    num_cand = min(num_candidates, processed.shape[1])
    cand = ops.top_k_values(processed, num_cand)
    k = t.top_k.astype(_F32)
    kth = jnp.sum(jnp.maximum(cand, ops.NO_THRESHOLD) * ops.one_hot(k, cand.shape, offset=1),
                  -1)
    kth_big = ops.largest_threshold(processed, lambda p: 1.0, k, run=any_big,
                                    init_key=t.seeds)
    return jnp.where((t.top_k > num_cand) & (t.top_k < vocab), kth_big, kth)


def _sample_rows(xb: jax.Array, block_max: jax.Array, row_max: jax.Array,
                 t: SamplingTensors, need_bits: jax.Array, vocab: int,
                 num_candidates: int) -> jax.Array:
    """Rejection sampling of the top-p nucleus, one pass per round (see the module doc)."""
    _, _, lo = _keep_bound(xb, row_max, t, vocab, num_candidates, _Need(need_bits))

    def cond(state):
        round_, tokens = state[0], state[3]
        return (jnp.max(tokens) >= 0) & (round_ < _MAX_ROUNDS)

    def body(state):
        # tokens: -1 - the accepted token, or the pending proposal. Round 0 proposes from
        # all kept tokens, and top_p times its total is the nucleus mass; rows without
        # top_p accept. Each later round proposes above the pending proposal, and its
        # total (the mass strictly above that proposal) accepts it if < nucleus mass.
        round_, lo, mass, tokens = state
        # The barrier ties the per-row inputs to the loop-varying lo, so that XLA hoists
        # nothing out of the loop: no [S, V] temporaries, and the per-row arithmetic
        # stays fused into the loop's kernels instead of kernels of its own.
        lo, row_max_, seeds, steps, temperature, top_p = lax.optimization_barrier(
            (lo, row_max, t.seeds, t.step_index, t.temperature, t.top_p))
        greedy = temperature < GREEDY_EPS
        inv_temp_ = 1.0 / jnp.where(greedy, 1.0, temperature)
        j, block, j_in_block, total = ops.pick(
            xb, lambda p: ops.kept_weights(p, row_max_, inv_temp_, lo),
            lambda p: ops.kept_weights_small(p, row_max_, inv_temp_, lo),
            lambda: jnp.where(greedy, 0.0, ops.uniforms(seeds, steps, round_)))
        first = round_ == 0
        mass = jnp.where(first, top_p * total, mass)
        accept_pending = ~first & (total < mass)
        tokens = jnp.where(tokens < 0, tokens, jnp.where(
            accept_pending, -1.0 - tokens, jnp.where(~greedy & (top_p < 1.0), j, -1.0 - j)))
        x_j = ops.take(block, j_in_block) * inv_temp_
        return round_ + 1, jnp.where(tokens >= 0, x_j, lo), mass, tokens

    # Initial mass and tokens are any (non-negative) existing buffers: round 0 sets both,
    # and a copy needs no kernel.
    tokens = lax.while_loop(cond, body, (jnp.int32(0), lo, lo, t.temperature))[3]
    # Rows still undecided after the cap (NaN logits) take their pending proposal.
    return jnp.minimum(jnp.where(tokens < 0, -1.0 - tokens, tokens), vocab - 1).astype(_I32)


# -- logprobs -----------------------------------------------------------------------------
def _logprobs(logits: jax.Array, tokens: jax.Array, k: int):
    num_rows, vocab = logits.shape
    m = jnp.max(logits, -1)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), -1))
    # vLLM: ties count as ahead. Counting in f32 keeps the fast reduction path on CPU.
    chosen = ops.take(logits, tokens)
    ranks = jnp.sum(jnp.where(logits >= chosen[:, None], 1.0, 0.0), -1).astype(_I32)
    sampled = chosen - lse
    if k == 0:
        return sampled, ranks, jnp.zeros((num_rows, 0), _I32), jnp.zeros((num_rows, 0), _F32)
    values, ids = ops.top_k(logits, min(k, vocab))
    if values.shape[1] < k:                                   # vocab smaller than K
        pad = ((0, 0), (0, k - values.shape[1]))
        values = jnp.pad(values, pad, constant_values=-jnp.inf)
        ids = jnp.pad(ids, pad)
    return sampled, ranks, ids.astype(_I32), values - lse[:, None]


# -- for tests and notebooks --------------------------------------------------------------
def sampling_probs(logits: jax.Array, t: SamplingTensors, *,
                   num_candidates: int = 64) -> jax.Array:
    """The distribution each random row samples from: [S, V], rows sum to 1.

    Same min_p / top_k thresholds as ``sample``; the top-p threshold is found exactly by
    bisection (``sample`` reaches the same distribution by rejection).
    """
    processed = process_logits(logits.astype(_F32), t)
    vocab = processed.shape[1]
    inv_temp, x_max, lo = _keep_bound(processed[:, None, :], jnp.max(processed, -1), t,
                                      vocab, num_candidates, _needs(t, vocab, num_candidates))
    x = processed * inv_temp[:, None]

    def kept(x, lo):
        return jnp.where(x > lo[:, None], jnp.exp(x - x_max[:, None]), 0.0)

    nucleus_mass = t.top_p * jnp.sum(kept(x, lo), -1)
    # The nucleus {mass above < nucleus_mass} is {x >= the largest T with mass(x >= T)
    # >= nucleus_mass}.
    top_p_thr = ops.largest_threshold(x, lambda x: kept(x, lo), nucleus_mass)
    top_p_on = (t.temperature >= GREEDY_EPS) & (t.top_p < 1.0)
    w = kept(x, jnp.where(top_p_on, jnp.maximum(lo, ops.strict_bound(top_p_thr)), lo))
    return w / jnp.sum(w, -1, keepdims=True)


def _uniforms(t: SamplingTensors, n: int) -> jax.Array:
    """[S, n] row uniforms, columns 0..n-1 (round r of the sampling loop uses column r)."""
    columns = lax.broadcasted_iota(_I32, (t.seeds.shape[0], n), 1)
    return ops.uniforms(t.seeds[:, None], t.step_index[:, None], columns)
