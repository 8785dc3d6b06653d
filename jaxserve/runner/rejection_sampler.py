"""Exact acceptance of point-mass drafts inside the jitted step.

With a draft that is a fixed token (n-gram lookup: q is a point mass on the draft d_j),
the speculative-sampling rule "accept with min(1, p(d)/q(d)), else resample from the
normalised max(0, p - q)" becomes: accept with probability p(d_j); on rejection, sample
from p with d_j removed. Drawing t_j ~ p_j (the target distribution at position j, with
every sampling parameter applied) and accepting iff t_j == d_j does exactly that: the
acceptance probability is p_j(d_j), and given t_j != d_j, t_j follows p_j restricted to
the other tokens, renormalised. So the emitted tokens are t_0 .. t_a, where a is the
number of leading positions whose target sample equals the draft: the accepted drafts,
then the correction (or, when every draft is accepted, the bonus token t_k). Greedy rows
are the same rule with t_j = argmax p_j: the longest matching prefix.

Each t_j is sampled with the uniforms of output index (n + j), as the non-speculative
sampler would at that index, so a seeded request reproduces, and emits the same tokens
with speculation on or off wherever the logits agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def num_emitted_tokens(target_tokens: jax.Array, draft_tokens: jax.Array,
                       num_drafts: jax.Array) -> jax.Array:
    """target_tokens: i32[R, k+1], the target's sample at each verified position;
    draft_tokens: i32[R, k]; num_drafts: i32[R] (0..k, drafts past it are padding).
    Returns i32[R]: 1 + the number of accepted drafts (tokens the row emits this step)."""
    k = draft_tokens.shape[1]
    valid = jnp.arange(k)[None, :] < num_drafts[:, None]
    match = (target_tokens[:, :k] == draft_tokens) & valid
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    return (accepted + 1).astype(jnp.int32)
