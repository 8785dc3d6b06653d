"""Ragged paged attention as a Pallas kernel (Triton backend on GPU, interpret on CPU).

Work decomposition
------------------
The flat token axis is cut, per sequence, into query blocks of `block_q`
tokens. Every (query block, KV head, KV split) is one program:

  grid = (num_q_blocks, Hkv, num_kv_splits),
  num_q_blocks = min(T, cdiv(T, block_q) + S)   (static upper bound)

The wrapper computes, with a handful of cheap jnp ops, which sequence and
token range each query block covers (`reference.query_blocks`, shared with
the jnp reference); blocks past the live ones write the padding rows as 0,
and splits past a sequence's context run zero loop iterations. This plays
the role of TPU scalar prefetch: metadata arrays are kernel inputs read with
scalar loads.

One program loads its tile of queries as a 2D [block_q * G_pad, D] matrix
(the G query heads of one KV head, padded to a power of two, times block_q
tokens), then loops over the sequence's keys `block_kv` at a time up to the
causal end of the block (`kv_lens`-bounded, never the table width), gathering
rows of the cache through the block table. Caches are viewed as
[num_blocks * block_size, Hkv * D] so one key is one contiguous row slice,
which keeps `block_kv` independent of the page size and never touches
blocks beyond kv_len. Online softmax runs in float32 (base-2 exponent).

Decode batches (few tokens) get split-K: each split covers a slice of the
context and writes (acc, max, sum) partials that a small jnp epilogue merges.

The kernel body only uses masked gathers/scatters (`plgpu.load/store` on
`ref.at[...]`), `lax.fori_loop` and 2D dots with both sizes >= 16, which is
what the Triton lowering supports. A Mosaic GPU variant can reuse
`query_blocks` and the split merge unchanged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.quantization.kv import SCALE_STEPS_PER_OCTAVE, QuantizedKV
from pallas_kernels.reference import num_query_blocks, query_blocks

# Finite "minus infinity": keeps fully masked rows free of inf - inf = NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2_E = math.log2(math.e)
# Triton's tl.dot wants every dimension >= 16.
_MIN_DOT_DIM = 16
# Aim for at least this many programs before splitting the context (an H100/H200
# has 132 SMs; two waves hide the tail).
_TARGET_PROGRAMS = 264
_MAX_KV_SPLITS = 16


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(
    # metadata, int32[num_q_blocks] each, and the block table int32[S, max_blocks]
    seq_ids_ref,
    token_start_ref,
    token_end_ref,
    position_offset_ref,
    kv_end_ref,
    kv_start_ref,
    window_ref,
    block_tables_ref,
    # data
    q_ref,  # [T * Hq, D]
    k_ref,  # [num_blocks * block_size, Hkv * D]
    v_ref,  # [num_blocks * block_size, Hkv * D]
    # quantized caches only: k and v scale codes [num_blocks * block_size * Hkv] int8;
    # then the outputs: final [T * Hq, D]; or, with splits, partials
    # acc [splits * T * Hq, D] f32, max and sum [splits * T * Hq] f32
    *refs,
    num_tokens: int,
    num_q_heads: int,
    group: int,
    group_padded: int,
    head_dim: int,
    head_dim_padded: int,
    num_kv_heads: int,
    block_size: int,
    num_blocks: int,
    max_blocks: int,
    block_q: int,
    block_kv: int,
    num_kv_splits: int,
    scale_log2: float,
    soft_cap: float,
    precision,
    quantized: bool,
):
    if quantized:
        k_scale_ref, v_scale_ref, *out_refs = refs
    else:
        k_scale_ref = v_scale_ref = None
        out_refs = refs
    block_idx = pl.program_id(0)
    kv_head = pl.program_id(1)
    split = pl.program_id(2)
    rows = block_q * group_padded

    seq = seq_ids_ref[block_idx]
    token_end = token_end_ref[block_idx]
    position_offset = position_offset_ref[block_idx]
    kv_end = kv_end_ref[block_idx]
    kv_lo = kv_start_ref[block_idx]  # first key a query of this block can see
    window = window_ref[block_idx]

    # Row r of the tile is token token_start + r // G_pad, head kv_head * G + r % G_pad.
    row = jnp.arange(rows, dtype=jnp.int32)
    token = token_start_ref[block_idx] + row // group_padded
    head_in_group = row % group_padded
    row_valid = (token < token_end) & (head_in_group < group)
    q_rows = (
        jnp.minimum(token, num_tokens - 1) * num_q_heads
        + kv_head * group
        + jnp.minimum(head_in_group, group - 1)
    )
    query_pos = token + position_offset

    # Every access is a gather with integer row and column arrays (the form both
    # the Triton lowering and the interpreter accept); a column iota keeps the
    # rows contiguous for Triton's vectorised loads. D is padded to a power of
    # two for Triton; padded columns load as 0 and are never stored.
    store_col = jnp.arange(head_dim_padded, dtype=jnp.int32)
    col_valid = store_col < head_dim
    col = jnp.minimum(store_col, head_dim - 1)[None, :]
    store_col = store_col[None, :]  # padded columns are out of range: never written
    kv_col = kv_head * head_dim + col

    def row_col_mask(row_mask):
        if head_dim_padded == head_dim:
            return row_mask[:, None]
        return row_mask[:, None] & col_valid[None, :]

    q = plgpu.load(q_ref.at[q_rows[:, None], col], mask=row_col_mask(row_valid), other=0)

    # This split's slice of [kv_lo, kv_end), in whole block_kv steps: with a sliding
    # window the keys before kv_lo are never visited, so cost follows the window.
    split_len = pl.cdiv(pl.cdiv(jnp.maximum(kv_end - kv_lo, 0), num_kv_splits), block_kv) * block_kv
    kv_start = kv_lo + split * split_len
    kv_stop = jnp.minimum(kv_end, kv_start + split_len)
    num_steps = pl.cdiv(jnp.maximum(kv_stop - kv_start, 0), block_kv)

    def load_kv(ref, scale_ref, slot, key_valid, kv_mask):
        """A [block_kv, D] tile of K or V in q's dtype: a quantized (int8 / fp8) cache is
        dequantized here, tile by tile (values in float32 times each slot's head scale,
        2 ** (code / 8): jaxserve/quantization/kv.py). Triton cannot splat an integer
        `other` into fp8, so 1-byte tiles load unfilled and masked lanes are zeroed after
        the cast."""
        if scale_ref is None:
            tile = plgpu.load(ref.at[slot[:, None], kv_col], mask=kv_mask, other=0)
            return tile.astype(q.dtype)
        tile = plgpu.load(ref.at[slot[:, None], kv_col], mask=kv_mask)
        code = plgpu.load(scale_ref.at[slot * num_kv_heads + kv_head], mask=key_valid, other=0)
        scale = jnp.exp2(code.astype(jnp.float32) * (1.0 / SCALE_STEPS_PER_OCTAVE))
        tile = jnp.where(kv_mask, tile.astype(jnp.float32) * scale[:, None], 0)
        return tile.astype(q.dtype)

    def body(step, carry):
        acc, m_prev, l_prev = carry
        key_pos = kv_start + step * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        key_valid = key_pos < kv_stop
        page = jnp.minimum(key_pos // block_size, max_blocks - 1)
        block_id = plgpu.load(block_tables_ref.at[seq, page], mask=key_valid, other=0)
        block_id = jnp.clip(block_id, 0, num_blocks - 1)
        slot = block_id * block_size + key_pos % block_size
        kv_mask = row_col_mask(key_valid)
        k = load_kv(k_ref, k_scale_ref, slot, key_valid, kv_mask)
        logits = plgpu.dot(q, k, trans_b=True, precision=precision)
        if soft_cap:
            logits = soft_cap * jnp.tanh(logits * (scale_log2 / _LOG2_E / soft_cap)) * _LOG2_E
        else:
            logits = logits * scale_log2
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        visible &= (window <= 0) | (query_pos[:, None] - key_pos[None, :] < window)
        logits = jnp.where(visible, logits, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=1))
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.where(visible, jnp.exp2(logits - m_next[:, None]), 0.0)
        l_next = l_prev * correction + p.sum(axis=1)
        v = load_kv(v_ref, v_scale_ref, slot, key_valid, kv_mask)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next

    acc = jnp.zeros((rows, head_dim_padded), jnp.float32)
    m = jnp.full((rows,), _MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = lax.fori_loop(0, num_steps, body, (acc, m, l))

    # Masked-off rows get an out-of-range index: Triton never touches them and
    # the interpreter's scatter drops them, so a clamped duplicate row can never
    # overwrite a valid one.
    out_mask = row_col_mask(row_valid)
    num_rows = num_tokens * num_q_heads
    if num_kv_splits == 1:
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        out_rows = jnp.where(row_valid, q_rows, num_rows)
        plgpu.store(o_ref.at[out_rows[:, None], store_col], out.astype(o_ref.dtype), mask=out_mask)
    else:
        acc_ref, m_ref, l_ref = out_refs
        part_rows = jnp.where(row_valid, split * num_rows + q_rows, num_kv_splits * num_rows)
        plgpu.store(acc_ref.at[part_rows[:, None], store_col], acc, mask=out_mask)
        plgpu.store(m_ref.at[part_rows], m, mask=row_valid)
        plgpu.store(l_ref.at[part_rows], l, mask=row_valid)


def _auto_num_kv_splits(num_programs: int) -> int:
    splits = _next_power_of_2(max(1, -(-_TARGET_PROGRAMS // max(1, num_programs))))
    return min(splits, _MAX_KV_SPLITS)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "block_q",
        "block_kv",
        "num_kv_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "logits_soft_cap",
    ),
)
def ragged_paged_attention(
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
    block_kv: int = 64,
    num_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sliding_window: int | jax.Array = 0,
    logits_soft_cap: float = 0.0,
) -> jax.Array:
    """Causal attention of ragged query tokens over a paged KV cache (Pallas).

    q: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (this
    step's K/V already written); kv_lens: int32[S]; block_tables:
    int32[S, max_blocks]; query_start_loc: int32[S + 1]; num_seqs: int32
    scalar (may be traced). Returns [T, Hq, D] in q's dtype; padding rows are 0.

    Tuning knobs: block_q (query tokens per program; default fills >= 16 rows
    of G_pad * block_q, more when T > S), block_kv (keys per inner step, a
    power of two >= 16), num_kv_splits (split-K over the context; default
    chosen from the static grid size, 1 for prefill-sized T), num_warps and
    num_stages (Triton).

    sliding_window > 0 (may be traced: a per-layer window scanned over layers): a query
    at position p sees keys k with p - sliding_window < k <= p; each query block starts
    its key loop at its first visible key. logits_soft_cap > 0 (static): logits =
    cap * tanh(logits / cap) after sm_scale. Both 0 = off, as in the reference.
    """
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be >= 0 (0 = off)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    quantized = isinstance(k_cache, QuantizedKV)
    if quantized != isinstance(v_cache, QuantizedKV):
        raise ValueError("k_cache and v_cache must both be quantized (QuantizedKV) or neither")
    num_padded_seqs, max_blocks = block_tables.shape
    if kv_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shapes {k_cache.shape}, {v_cache.shape} do not match q head_dim {head_dim}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    if query_start_loc.shape != (num_padded_seqs + 1,) or kv_lens.shape != (num_padded_seqs,):
        raise ValueError(
            f"query_start_loc {query_start_loc.shape} / kv_lens {kv_lens.shape} do not match "
            f"block_tables {block_tables.shape}"
        )
    if block_kv < _MIN_DOT_DIM or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv={block_kv} must be a power of two >= {_MIN_DOT_DIM}")
    group = num_q_heads // num_kv_heads
    group_padded = _next_power_of_2(group)
    min_block_q = max(1, _MIN_DOT_DIM // group_padded)
    if block_q is None:
        # Decode-heavy shapes (T <= S) get the smallest tile; prefill a 64-row one.
        target_rows = _MIN_DOT_DIM if num_tokens <= num_padded_seqs else 64
        block_q = max(min_block_q, target_rows // group_padded)
    if block_q < min_block_q or block_q & (block_q - 1):
        raise ValueError(
            f"block_q={block_q} must be a power of two >= {min_block_q} "
            f"(block_q * {group_padded} query rows must reach {_MIN_DOT_DIM})"
        )
    num_q_blocks = num_query_blocks(num_tokens, num_padded_seqs, block_q)
    if num_kv_splits is None:
        num_kv_splits = _auto_num_kv_splits(num_q_blocks * num_kv_heads)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    scale = head_dim**-0.5 if sm_scale is None else sm_scale

    num_seqs = jnp.asarray(num_seqs, jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    blocks = query_blocks(
        query_start_loc,
        kv_lens,
        num_seqs,
        num_tokens=num_tokens,
        block_q=block_q,
        num_q_blocks=num_q_blocks,
    )

    window = jnp.asarray(sliding_window, jnp.int32)
    first_pos = blocks.token_start + blocks.position_offset
    kv_start = jnp.where((window > 0) & (blocks.kv_end > 0),
                         jnp.maximum(first_pos - window + 1, 0), 0).astype(jnp.int32)
    windows = jnp.broadcast_to(window, kv_start.shape)  # read per program like the metadata

    num_rows = num_tokens * num_q_heads
    q_flat = q.reshape(num_rows, head_dim)
    scales = ()
    if quantized:   # the scale codes ride as two more flat inputs
        scales = (k_cache.scale.reshape(-1), v_cache.scale.reshape(-1))
        k_cache, v_cache = k_cache.data, v_cache.data
    k_flat = k_cache.reshape(num_blocks * block_size, num_kv_heads * head_dim)
    v_flat = v_cache.reshape(num_blocks * block_size, num_kv_heads * head_dim)

    if num_kv_splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_rows, head_dim), q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((num_kv_splits * num_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits * num_rows,), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits * num_rows,), jnp.float32),
        )
    kernel = functools.partial(
        _kernel,
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        group=group,
        group_padded=group_padded,
        head_dim=head_dim,
        head_dim_padded=_next_power_of_2(head_dim),
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        num_blocks=num_blocks,
        max_blocks=max_blocks,
        block_q=block_q,
        block_kv=block_kv,
        num_kv_splits=num_kv_splits,
        scale_log2=scale * _LOG2_E,
        soft_cap=float(logits_soft_cap),
        # f32 inputs: exact f32 dots (no TF32) so the kernel matches the reference.
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
        quantized=quantized,
    )
    outputs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_q_blocks, num_kv_heads, num_kv_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        blocks.seq_ids,
        blocks.token_start,
        blocks.token_end,
        blocks.position_offset,
        blocks.kv_end,
        kv_start,
        windows,
        block_tables.astype(jnp.int32),
        q_flat,
        k_flat,
        v_flat,
        *scales,
    )

    if num_kv_splits > 1:
        outputs = _merge_splits(*outputs, num_kv_splits=num_kv_splits).astype(q.dtype)
    return outputs.reshape(num_tokens, num_q_heads, head_dim)


def _merge_splits(acc, m, l, *, num_kv_splits: int) -> jax.Array:
    """Combine split-K partials (max and sum in base 2) into normalised rows."""
    acc = acc.reshape(num_kv_splits, -1, acc.shape[-1])
    m = m.reshape(num_kv_splits, -1)
    l = l.reshape(num_kv_splits, -1)
    # Every split wrote every row: splits with no keys for a row left
    # (0, _MASK_VALUE, 0), which weighs 0 next to any real max, and padding
    # rows have no keys in any split and come out 0.
    m_max = m.max(axis=0)
    weight = jnp.exp2(m - m_max[None])
    total = (weight * l).sum(axis=0)
    out = (weight[..., None] * acc).sum(axis=0)
    return out / jnp.where(total > 0, total, 1.0)[:, None]
