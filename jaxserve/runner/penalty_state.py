"""Device-resident token history for the repetition / frequency / presence penalties.

Per persistent batch row: how often each vocabulary token was emitted as an output token,
and whether it occurs in the prompt (vLLM: repetition over prompt + output, frequency and
presence over output only). The tables live on the device for the runner's lifetime, so a
step ships no history at all:

- admission (`load_history`, its own small executable, run before the step that first
  schedules the row): the row is zeroed, then every token the host knows of the sequence
  is counted once -- positions below ``num_prompt_tokens`` as prompt tokens, the rest as
  output tokens (a resumed, preempted sequence brings its earlier outputs). O(history),
  once per sequence, only for rows that use a penalty.
- every step (`count_emitted`, inside the jitted step, after sampling): the tokens each
  sampling penalty row emitted are added. O(S * (k + 1)).

A row's tables are read only while it holds a sequence with a penalty, and such a sequence
always reloads them at admission, so rows without a penalty are never updated or reset.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Entries of a history chunk, `load_history`'s ``entries[3, C]``.
ROW, TOKEN, IS_PROMPT = range(3)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    """[R + 1, V] tables, one row per persistent batch row (the last one is padding)."""

    output_counts: jax.Array   # i32[R + 1, V]: output tokens emitted so far
    prompt_seen: jax.Array     # bool[R + 1, V]: token occurs in the prompt

    @staticmethod
    def nbytes(num_rows: int, vocab: int) -> int:
        return num_rows * vocab * (4 + 1)


def empty_penalty_state(num_rows: int, vocab: int) -> PenaltyState:
    return PenaltyState(jnp.zeros((num_rows, vocab), jnp.int32),
                        jnp.zeros((num_rows, vocab), jnp.bool_))


def history_chunk_size(max_model_len: int) -> int:
    """Entries per `load_history` call: a whole sequence's history fits in one."""
    return max(1024, 1 << (max_model_len - 1).bit_length())


def load_history(state: PenaltyState, resets: jax.Array, entries: jax.Array) -> PenaltyState:
    """Zero the rows in ``resets`` (i32[M]: rows first, -1 padded), then count ``entries``
    (i32[3, C]: row, token, is_prompt; row -1 = unused). A row's reset travels in the same
    or an earlier call than its tokens."""
    num_rows, vocab = state.output_counts.shape
    num_resets = jnp.sum(resets >= 0)

    def zero_row(i, tables):
        counts, seen = tables
        row = resets[i]
        counts = lax.dynamic_update_slice(counts, jnp.zeros((1, vocab), counts.dtype), (row, 0))
        seen = lax.dynamic_update_slice(seen, jnp.zeros((1, vocab), seen.dtype), (row, 0))
        return counts, seen

    counts, seen = lax.fori_loop(0, num_resets, zero_row,
                                 (state.output_counts, state.prompt_seen))
    rows, tokens, is_prompt = entries[ROW], entries[TOKEN], entries[IS_PROMPT] > 0
    valid = (rows >= 0) & (tokens >= 0) & (tokens < vocab)
    # Rows out of range are dropped: the unused entries and the other kind's.
    output_rows = jnp.where(valid & ~is_prompt, rows, num_rows)
    prompt_rows = jnp.where(valid & is_prompt, rows, num_rows)
    counts = counts.at[output_rows, tokens].add(1, mode="drop")
    seen = seen.at[prompt_rows, tokens].set(True, mode="drop")
    return PenaltyState(counts, seen)


def count_emitted(state: PenaltyState, rows: jax.Array, tokens: jax.Array,
                  counted: jax.Array) -> PenaltyState:
    """Add this step's output tokens: rows i32[S] (persistent rows), tokens i32[S, n],
    counted bool[S, n] (the row samples, uses a penalty, and emitted that column)."""
    num_rows, vocab = state.output_counts.shape
    target = jnp.where(counted & (tokens >= 0) & (tokens < vocab), rows[:, None], num_rows)
    return PenaltyState(state.output_counts.at[target, tokens].add(1, mode="drop"),
                        state.prompt_seen)


def history_entries(rows: np.ndarray, token_lists: list[np.ndarray],
                    num_prompt: list[int], chunk: int) -> list[np.ndarray]:
    """Host side of admission: the known tokens of each admitted row as `load_history`
    chunks (i32[3, chunk] each, -1 padded); a row's tokens never precede its reset."""
    total = sum(len(t) for t in token_lists)
    flat = np.full((3, max(1, -(-total // chunk)) * chunk), -1, np.int32)
    start = 0
    for row, tokens, prompt in zip(rows.tolist(), token_lists, num_prompt):
        end = start + len(tokens)
        flat[ROW, start:end] = row
        flat[TOKEN, start:end] = tokens
        flat[IS_PROMPT, start:end] = np.arange(len(tokens)) < prompt
        start = end
    return [flat[:, i:i + chunk] for i in range(0, flat.shape[1], chunk)]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyHistory:
    """What the sampler reads of the tables: sampled row s's history is table row rows[s]."""

    rows: jax.Array       # i32[S]
    state: PenaltyState

    def gather(self) -> tuple[jax.Array, jax.Array]:
        """(output counts f32[S, V], prompt_seen bool[S, V]) of the sampled rows."""
        return (self.state.output_counts[self.rows].astype(jnp.float32),
                self.state.prompt_seen[self.rows])
