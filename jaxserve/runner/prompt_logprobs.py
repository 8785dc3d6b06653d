"""Prompt logprobs on the device: the LM head on the prompt positions of rows that ask.

The step's forward returns the hidden states of every token; sampling needs the logits of
one token per row, prompt logprobs those of up to P = min(T, prompt_logprobs_cap) prompt
positions (a fixed-size gather, so the shape never changes). The work sits behind a
``lax.cond`` on "does any slot hold a position": a step where no request asks pays for
one reduction over P int32s, not for P rows of LM head.

Only small arrays leave the device: per slot the logprob and vocab rank of the actual
next prompt token, and the top-K ids and logprobs (K = max_logprobs, static).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runner.sampler import _logprobs as token_logprobs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptLogprobsOutput:
    """Per slot p of the step's prompt-logprobs gather (zeros in unused slots)."""

    logprobs: jax.Array         # f32[P], of prompt_logprobs_targets[p]
    ranks: jax.Array            # i32[P], tokens with logprob >= it (vLLM's rank, 1 = best)
    top_token_ids: jax.Array    # i32[P, K]
    top_logprobs: jax.Array     # f32[P, K]


def prompt_logprobs(logits_of: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    indices: jax.Array, targets: jax.Array,
                    num_top_logprobs: int) -> PromptLogprobsOutput:
    """hidden: [T, H]; indices, targets: i32[P] (target -1: unused slot); logits_of maps
    [P, H] hidden rows to [P, V] float32 logits (final norm + LM head)."""
    num_slots, k = indices.shape[0], num_top_logprobs

    def compute(hidden, indices, targets):
        logits = logits_of(hidden[indices])
        # The RAW logits, as for sample logprobs (vLLM: no penalties or temperature).
        return PromptLogprobsOutput(*token_logprobs(logits, jnp.maximum(targets, 0), k))

    def skip(hidden, indices, targets):
        return PromptLogprobsOutput(jnp.zeros(num_slots, jnp.float32),
                                    jnp.zeros(num_slots, jnp.int32),
                                    jnp.zeros((num_slots, k), jnp.int32),
                                    jnp.zeros((num_slots, k), jnp.float32))

    return lax.cond(jnp.max(targets) >= 0, compute, skip, hidden, indices, targets)
