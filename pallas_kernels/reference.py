"""Pure-jnp ragged paged attention: the test oracle and the CPU execution path.

Shapes (see `ragged_paged_attention_reference`):
  q:               [T, Hq, D]        query tokens of all sequences, flat
  k_cache/v_cache: [num_blocks, block_size, Hkv, D]
  kv_lens:         int32[S]          cached tokens of sequence i, this step's included
  block_tables:    int32[S, max_blocks]
  query_start_loc: int32[S + 1]
  num_seqs:        int32 scalar, may be traced; sequences >= num_seqs are padding

Cost follows the live context: the KV is visited in chunks of blocks by a loop
whose trip count is ceil(max(kv_lens[:num_seqs]) / chunk_tokens), with an
online softmax, so a wide block table (max_model_len) or a huge multi-layer
cache costs nothing by itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Elements of the per-chunk gathered K (or V) tile [T, chunk_tokens, Hkv, D]
# the automatic chunk size aims for: big enough to amortise the loop, small
# enough that a 2048-token prefill does not gather gigabytes per step.
_GATHER_BUDGET_ELEMENTS = 1 << 24
_MAX_CHUNK_TOKENS = 256


def token_metadata(
    query_start_loc: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token sequence id, absolute position and validity.

    Returns (seq_ids int32[T] clipped into [0, S), positions int32[T], valid bool[T]).
    Padding tokens (at or beyond query_start_loc[num_seqs]) get position -1, so
    they attend to nothing.
    """
    num_padded_seqs = kv_lens.shape[0]
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    # Number of sequence ends <= t: the sequence holding t (empty ones skipped).
    seq_ids = jnp.searchsorted(query_start_loc[1:], token_idx, side="right")
    seq_ids = jnp.clip(seq_ids, 0, num_padded_seqs - 1).astype(jnp.int32)
    num_valid_tokens = query_start_loc[jnp.clip(num_seqs, 0, num_padded_seqs)]
    valid = token_idx < num_valid_tokens
    q_starts = query_start_loc[seq_ids]
    q_lens = query_start_loc[seq_ids + 1] - q_starts
    positions = kv_lens[seq_ids] - q_lens + (token_idx - q_starts)
    positions = jnp.where(valid, positions, -1).astype(jnp.int32)
    return seq_ids, positions, valid


def default_chunk_blocks(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Blocks per KV chunk so the gathered tile stays near the budget (static)."""
    tokens = _GATHER_BUDGET_ELEMENTS // max(1, num_tokens * num_kv_heads * head_dim)
    tokens = max(block_size, min(_MAX_CHUNK_TOKENS, tokens))
    return max(1, tokens // block_size)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array | int,
    *,
    sm_scale: float | None = None,
    kv_chunk_blocks: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of ragged query tokens over a paged KV cache.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    kv_lens: int32[S]; block_tables: int32[S, max_blocks];
    query_start_loc: int32[S + 1]; num_seqs: int32 scalar.
    Returns [T, Hq, D] in q's dtype; rows of padding tokens are 0.
    `interpret` is accepted for signature parity with the kernel and ignored.
    """
    del interpret
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_padded_seqs, max_blocks = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if kv_chunk_blocks is None:
        kv_chunk_blocks = default_chunk_blocks(num_tokens, num_kv_heads, head_dim, block_size)
    if kv_chunk_blocks < 1:
        raise ValueError(f"kv_chunk_blocks={kv_chunk_blocks} must be >= 1")
    chunk_tokens = kv_chunk_blocks * block_size

    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_ids, positions, _ = token_metadata(query_start_loc, kv_lens, num_seqs, num_tokens)

    # Pad the width to whole chunks so the dynamic slice below never clamps
    # (a clamped slice would silently re-read earlier blocks).
    num_chunks_max = -(-max_blocks // kv_chunk_blocks)
    pad = num_chunks_max * kv_chunk_blocks - max_blocks
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, pad)))

    live = jnp.arange(num_padded_seqs) < num_seqs
    max_kv_len = jnp.max(jnp.where(live, kv_lens, 0))
    num_chunks = jnp.minimum((max_kv_len + chunk_tokens - 1) // chunk_tokens, num_chunks_max)

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * scale
    m0 = jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32)
    acc0 = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32)

    def body(chunk, carry):
        m, l, acc = carry
        first_block = chunk * kv_chunk_blocks
        blocks = lax.dynamic_slice_in_dim(block_tables, first_block, kv_chunk_blocks, axis=1)
        blocks = jnp.clip(blocks[seq_ids], 0, num_blocks - 1)  # [T, chunk_blocks]
        k = k_cache[blocks].reshape(num_tokens, chunk_tokens, num_kv_heads, head_dim)
        v = v_cache[blocks].reshape(num_tokens, chunk_tokens, num_kv_heads, head_dim)
        logits = jnp.einsum(
            "thgd,tchd->thgc", qf, k.astype(jnp.float32), preferred_element_type=jnp.float32
        )
        key_pos = first_block * block_size + jnp.arange(chunk_tokens, dtype=jnp.int32)
        visible = key_pos[None, :] <= positions[:, None]  # [T, C]; implies key_pos < kv_len
        logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        # Rows that have seen no visible key keep m = -inf; shift by 0 instead.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "thgc,tchd->thgd", p, v.astype(jnp.float32), preferred_element_type=jnp.float32
        )
        return m_new, l, acc

    _, l, acc = lax.fori_loop(0, num_chunks, body, (m0, l0, acc0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
