"""Verification of draft tokens inside the jitted step.

A row with d drafts was scheduled as a ragged query chunk of d + 1 tokens (its newest token,
then the drafts), so the forward already produced the hidden states of all of them. Here
the LM head runs on k + 1 positions for each of the first ``num_spec_rows`` rows (a fixed
[num_spec_rows * (k + 1)] gather: static shapes, no compile per draft count; positions past
a row's drafts repeat its last one), the ordinary sampler samples every position with the
row's sampling parameters (position j: output index n + j, with drafts 0..j-1 counted as
output tokens for the penalties), and `num_emitted_tokens` applies the acceptance rule.

Outputs are laid out [S, k + 1] (flattened), a row's emitted tokens first; steps without
any draft take the plain path (one position per row) behind a ``lax.cond``, so they pay
for one LM-head row per sequence as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.runner.penalty_state import PenaltyHistory
from jaxserve.runner.rejection_sampler import num_emitted_tokens
from jaxserve.runner.sampler import SamplerOutput, sample
from jaxserve.runner.sampling_tensors import SamplingTensors


def widen(out: SamplerOutput, width: int) -> SamplerOutput:
    """[S, ...] per-row outputs → [S * width, ...], each row's value at its column 0."""
    def one(x):
        wide = jnp.zeros((x.shape[0], width) + x.shape[1:], x.dtype).at[:, 0].set(x)
        return wide.reshape((-1,) + x.shape[1:])
    return jax.tree.map(one, out)


def sample_with_drafts(hidden: jax.Array, logits_of: Callable[[jax.Array], jax.Array],
                       token_ids: jax.Array, logits_indices: jax.Array, num_drafts: jax.Array,
                       sampling: SamplingTensors, grammar_bitmask: jax.Array, *,
                       num_spec_tokens: int, num_spec_rows: int, num_top_logprobs: int,
                       penalty_history: PenaltyHistory | None = None
                       ) -> tuple[SamplerOutput, jax.Array]:
    """Sample every row's next token(s). hidden: [T, H]; token_ids: i32[T] (resolved);
    logits_indices, num_drafts: i32[S] (the row's last position, its draft count; rows at or
    past num_spec_rows have none); sampling: [S] tensors for the rows' first new token;
    penalty_history: the device-resident penalty history of the S rows (or None).

    Returns (SamplerOutput with fields [S * (k + 1), ...], num_emitted i32[S])."""
    k, rows = num_spec_tokens, num_spec_rows
    num_seqs = logits_indices.shape[0]
    width = k + 1

    def plain(hidden, token_ids, sampling, grammar_bitmask, history):
        out = sample(logits_of(hidden[logits_indices]), sampling, num_top_logprobs,
                     grammar_bitmask=grammar_bitmask, penalty_history=history)
        return widen(out, width), jnp.ones(num_seqs, jnp.int32)

    def speculative(hidden, token_ids, sampling, grammar_bitmask, history):
        drafts_n = num_drafts[:rows]
        first = logits_indices[:rows] - drafts_n                 # the row's newest token
        column = jnp.arange(width)
        positions = first[:, None] + jnp.minimum(column[None, :], drafts_n[:, None])
        draft_positions = first[:, None] + 1 + jnp.minimum(
            column[None, :k], jnp.maximum(drafts_n - 1, 0)[:, None])
        drafts = jnp.where(column[None, :k] < drafts_n[:, None], token_ids[draft_positions],
                           -1)                                      # [rows, k]
        logits = logits_of(hidden[positions.reshape(-1)])            # [rows * width, V]

        def expand(x):                     # [S, ...] → [rows * width, ...], row-major
            return jnp.repeat(x[:rows], width, axis=0)

        # Drafts before position j count as output tokens for the penalties at j.
        before = jnp.where(column[None, None, :k] < column[None, :, None],
                           drafts[:, None, :], -1).reshape(rows * width, k)
        newest = jnp.concatenate([expand(sampling.newest_token_ids)[:, None], before], 1)
        step_index = expand(sampling.step_index - num_drafts) + jnp.tile(column, rows)
        expanded = replace(jax.tree.map(expand, sampling), newest_token_ids=newest,
                           step_index=step_index)
        if history is not None:     # the rows' table rows, repeated; the tables as they are
            history = replace(history, rows=expand(history.rows))
        out = sample(logits, expanded, num_top_logprobs,
                     grammar_bitmask=expand(grammar_bitmask), penalty_history=history)
        num_emitted = num_emitted_tokens(out.next_tokens.reshape(rows, width), drafts,
                                         drafts_n)

        def pad(x):                        # rows → S rows (the rest are padding)
            return jnp.zeros((num_seqs * width,) + x.shape[1:], x.dtype).at[:rows * width].set(x)
        return jax.tree.map(pad, out), jnp.ones(num_seqs, jnp.int32).at[:rows].set(num_emitted)

    return lax.cond(jnp.any(num_drafts > 0), speculative, plain, hidden, token_ids, sampling,
                    grammar_bitmask, penalty_history)


def last_emitted(out: SamplerOutput, num_emitted: jax.Array) -> jax.Array:
    """i32[S]: each row's newest token (what the next step's decode reads on the device)."""
    tokens = out.next_tokens.reshape(num_emitted.shape[0], -1)
    return jnp.take_along_axis(tokens, (num_emitted - 1)[:, None], 1)[:, 0]
