"""Pure-jnp ragged paged attention: the test oracle and the CPU execution path.

Shapes (see `ragged_paged_attention_reference`):
  q:               [T, Hq, D]        query tokens of all sequences, flat
  k_cache/v_cache: [num_blocks, block_size, Hkv, D]
  kv_lens:         int32[S]          cached tokens of sequence i, this step's included
  block_tables:    int32[S, max_blocks]
  query_start_loc: int32[S + 1]
  num_seqs:        int32 scalar, may be traced; sequences >= num_seqs are padding

The flat token axis is cut, per sequence, into query blocks of block_q tokens
(`query_blocks`, shared with the Pallas kernel). Each block gathers its
sequence's pages one chunk at a time ([blocks, chunk_tokens, Hkv, D]) and
runs an online softmax in float32. The chunk loop's trip count is
ceil(max live kv_len / chunk_tokens), so cost follows the live context: a wide
block table (max_model_len) or a huge multi-layer cache costs nothing by itself.
The last partial chunk is walked in quarter chunks, so a span just over a chunk (a
sliding window of 256 keys starting mid-page covers 17 pages) gathers 20 pages, not 32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.quantization.kv import QuantizedKV, decode_scale

# Elements of the per-chunk gathered K (or V) tile [num_q_blocks, chunk_tokens,
# Hkv, D] the automatic chunk size aims for: big enough to amortise the loop,
# small enough that a long prefill does not gather gigabytes per step.
_GATHER_BUDGET_ELEMENTS = 1 << 24
_MAX_CHUNK_TOKENS = 256
_MAX_BLOCK_Q = 16


def num_query_blocks(num_tokens: int, num_padded_seqs: int, block_q: int) -> int:
    """Static number of query blocks that covers any batch of these padded sizes."""
    return min(num_tokens, -(-num_tokens // block_q) + num_padded_seqs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryBlocks:
    """Per query block b: sequence, token range [token_start, token_end), key range end.

    All int32[num_q_blocks]; position(t) = t + position_offset for tokens of
    the block. Blocks past the live ones cover the padding tokens with
    kv_end == 0 (no keys: their rows are written as 0), then nothing.
    """

    seq_ids: jax.Array
    token_start: jax.Array
    token_end: jax.Array
    position_offset: jax.Array
    kv_end: jax.Array


def query_blocks(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    block_q: int,
    num_q_blocks: int,
) -> QueryBlocks:
    """Cut each live sequence's tokens into blocks of block_q; see QueryBlocks.

    num_q_blocks = num_query_blocks(T, S, block_q) always suffices.
    """
    # num_q_blocks = min(T, cdiv(T, block_q) + S) always suffices: live blocks
    # number sum(ceil(q_len / block_q)) < T_live / block_q + S (and <= T_live),
    # which leaves at least ceil((T - T_live) / block_q) blocks for the padding.
    num_padded_seqs = kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    live = jnp.arange(num_padded_seqs) < num_seqs
    blocks_per_seq = jnp.where(live, (q_lens + block_q - 1) // block_q, 0)
    cum_blocks = jnp.cumsum(blocks_per_seq)
    num_live_blocks = cum_blocks[-1]
    block_idx = jnp.arange(num_q_blocks, dtype=jnp.int32)
    # compare_all: one fused op on GPU instead of a log(S)-step loop.
    seq_ids = jnp.searchsorted(cum_blocks, block_idx, side="right", method="compare_all")
    seq_ids = jnp.clip(seq_ids, 0, num_padded_seqs - 1)
    active = block_idx < num_live_blocks
    first_block = cum_blocks[seq_ids] - blocks_per_seq[seq_ids]
    seq_end = query_start_loc[seq_ids + 1]
    live_start = query_start_loc[seq_ids] + (block_idx - first_block) * block_q
    num_live_tokens = query_start_loc[jnp.clip(num_seqs, 0, num_padded_seqs)]
    pad_start = num_live_tokens + (block_idx - num_live_blocks) * block_q
    token_start = jnp.where(active, live_start, pad_start)
    token_end = jnp.where(
        active,
        jnp.minimum(live_start + block_q, seq_end),
        jnp.minimum(pad_start + block_q, num_tokens),
    )
    position_offset = jnp.where(active, kv_lens[seq_ids] - seq_end, 0)
    kv_end = jnp.where(active, token_end + position_offset, 0)
    return QueryBlocks(
        *(x.astype(jnp.int32) for x in (seq_ids, token_start, token_end, position_offset, kv_end))
    )


def default_block_q(num_tokens: int, num_padded_seqs: int) -> int:
    """Query tokens per block (static): 1 for decode-sized buckets, up to 16 for prefill."""
    per_seq = max(1, min(_MAX_BLOCK_Q, num_tokens // max(1, num_padded_seqs)))
    return 1 << (per_seq.bit_length() - 1)


def default_chunk_blocks(num_rows: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Pages per KV chunk so the gathered [num_rows, chunk, Hkv, D] tile stays near budget."""
    tokens = _GATHER_BUDGET_ELEMENTS // max(1, num_rows * num_kv_heads * head_dim)
    tokens = max(block_size, min(_MAX_CHUNK_TOKENS, tokens))
    return max(1, tokens // block_size)


def read_pages(cache, pages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Gather pages of a cache as float32 [.., chunk_tokens, Hkv, D]; a quantized cache
    (QuantizedKV: int8 / fp8 values + per-slot-head scales) is dequantized here, per chunk."""
    if isinstance(cache, QuantizedKV):
        scale = decode_scale(cache.scale[pages].reshape(*shape[:-1], 1))
        return cache.data[pages].reshape(shape).astype(jnp.float32) * scale
    return cache[pages].reshape(shape).astype(jnp.float32)


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
    block_q: int | None = None,
    kv_chunk_blocks: int | None = None,
    interpret: bool = False,
    sliding_window: int | jax.Array = 0,
    logits_soft_cap: float = 0.0,
) -> jax.Array:
    """Causal attention of ragged query tokens over a paged KV cache.

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    kv_lens: int32[S]; block_tables: int32[S, max_blocks];
    query_start_loc: int32[S + 1]; num_seqs: int32 scalar.
    Returns [T, Hq, D] in q's dtype; rows of padding tokens are 0.

    block_q (query tokens per block) and kv_chunk_blocks (pages per loop step)
    only trade gather volume against wasted rows; both default from the static
    shapes. `interpret` is accepted for signature parity with the kernel.

    Optional, off by default (0), as in the CPU kernel (jaxserve.attention.cpu):
    sliding_window > 0: a query at position p sees only keys at positions
      k with p - k < sliding_window (and k <= p). It may be a traced int32 scalar
      (a per-layer window scanned over layers); each query block's loop then starts
      at the page holding its first visible key, so cost follows the window, not the
      context;
    logits_soft_cap > 0: logits = cap * tanh(logits / cap), after sm_scale.
    """
    del interpret
    if logits_soft_cap < 0 or (isinstance(sliding_window, int) and sliding_window < 0):
        raise ValueError("sliding_window and logits_soft_cap must be >= 0 (0 = off)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_padded_seqs, max_blocks = block_tables.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if block_q is None:
        block_q = default_block_q(num_tokens, num_padded_seqs)
    num_q_blocks = num_query_blocks(num_tokens, num_padded_seqs, block_q)
    if kv_chunk_blocks is None:
        kv_chunk_blocks = default_chunk_blocks(num_q_blocks, num_kv_heads, head_dim, block_size)
    if block_q < 1 or kv_chunk_blocks < 1:
        raise ValueError(f"block_q={block_q} and kv_chunk_blocks={kv_chunk_blocks} must be >= 1")

    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    blocks = query_blocks(
        query_start_loc.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        num_seqs,
        num_tokens=num_tokens,
        block_q=block_q,
        num_q_blocks=num_q_blocks,
    )
    tokens = blocks.token_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)  # [P, bq]
    row_valid = tokens < blocks.token_end[:, None]
    positions = tokens + blocks.position_offset[:, None]
    # Padding tokens (blocks with kv_end == 0) get position -1: they see no key.
    positions = jnp.where(row_valid & (positions < blocks.kv_end[:, None]), positions, -1)
    tokens = jnp.clip(tokens, 0, num_tokens - 1)

    # Each query block walks its own page range: from the page of its first visible key
    # (0 without a window) to its causal end, a chunk of pages at a time.
    window = jnp.asarray(sliding_window, jnp.int32)
    first_pos = blocks.token_start + blocks.position_offset
    first_key = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    first_page = jnp.where(blocks.kv_end > 0, first_key // block_size, 0)  # [P]
    span = jnp.maximum(blocks.kv_end - first_page * block_size, 0)
    span_pages = (jnp.max(span) + block_size - 1) // block_size
    # Whole chunks, then the rest in tail chunks of a quarter chunk (static sizes both):
    # the pages gathered past the span are at most a quarter chunk, not a whole one.
    tail_blocks = max(1, kv_chunk_blocks // 4)
    num_chunks = span_pages // kv_chunk_blocks
    num_tail_chunks = (span_pages - num_chunks * kv_chunk_blocks + tail_blocks - 1) // tail_blocks
    block_tables = block_tables.astype(jnp.int32)

    shape = (num_q_blocks, block_q, num_kv_heads, group)
    qf = q.astype(jnp.float32)[tokens].reshape(*shape, head_dim) * scale
    m0 = jnp.full(shape, -jnp.inf, jnp.float32)
    l0 = jnp.zeros(shape, jnp.float32)
    acc0 = jnp.zeros((*shape, head_dim), jnp.float32)

    def step(page_offset, chunk_blocks, carry):
        """Online softmax over pages [first_page + page_offset, + chunk_blocks) of each block."""
        m, l, acc = carry
        page_idx = first_page[:, None] + page_offset + jnp.arange(chunk_blocks)
        # Pages past the table width are clamped; their keys lie past every position
        # (>= max_blocks * block_size > kv_end) and are masked below.
        pages = block_tables[blocks.seq_ids[:, None], jnp.minimum(page_idx, max_blocks - 1)]
        pages = jnp.clip(pages, 0, num_blocks - 1)  # [P, chunk_blocks]
        kv_shape = (num_q_blocks, chunk_blocks * block_size, num_kv_heads, head_dim)
        k, v = read_pages(k_cache, pages, kv_shape), read_pages(v_cache, pages, kv_shape)
        logits = jnp.einsum("pqhgd,pchd->pqhgc", qf, k, preferred_element_type=jnp.float32)
        if logits_soft_cap:
            logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
        key_pos = (page_idx[:, :, None] * block_size
                   + jnp.arange(block_size, dtype=jnp.int32)).reshape(num_q_blocks, 1, -1)
        # key_pos <= position implies key_pos < kv_len; padding rows see nothing.
        visible = key_pos <= positions[..., None]  # [P, bq, C]
        visible &= (window <= 0) | (positions[..., None] - key_pos < window)
        logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        # Rows that have seen no visible key keep m = -inf; shift by 0 instead.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(logits - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "pqhgc,pchd->pqhgd", p, v, preferred_element_type=jnp.float32
        )
        return m_new, l, acc

    carry = lax.fori_loop(0, num_chunks, lambda c, carry: step(
        c * kv_chunk_blocks, kv_chunk_blocks, carry), (m0, l0, acc0))
    _, l, acc = lax.fori_loop(0, num_tail_chunks, lambda c, carry: step(
        num_chunks * kv_chunk_blocks + c * tail_blocks, tail_blocks, carry), carry)
    rows = acc / jnp.where(l > 0, l, 1.0)[..., None]
    rows = rows.reshape(num_q_blocks * block_q, num_q_heads, head_dim).astype(q.dtype)
    # Each valid token is exactly one row; other rows are dropped, padding stays 0.
    targets = jnp.where(row_valid, tokens, num_tokens).reshape(-1)
    out = jnp.zeros_like(q)
    return out.at[targets].set(rows, mode="drop", unique_indices=False)
