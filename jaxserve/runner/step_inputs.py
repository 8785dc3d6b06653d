"""Per-step model inputs: built in numpy, packed into one int32 buffer, sent once.

Layout of the packed buffer for a (T, S) bucket with block-table width W:
  token_ids[T] | positions[T] | slot_mapping[T] | query_start_loc[S+1] | kv_lens[S]
  | logits_indices[S] | num_seqs[1] | block_tables[S*W]
`unpack` slices it apart inside jit with static offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    slot_mapping: jax.Array     # i32[T], -1 for padding tokens
    kv_lens: jax.Array          # i32[S], cache length after this step (0 for padding)
    block_tables: jax.Array     # i32[S, W]
    query_start_loc: jax.Array  # i32[S+1]
    num_seqs: jax.Array         # i32 scalar


def packed_size(num_tokens: int, num_seqs: int, width: int) -> int:
    return 3 * num_tokens + 3 * num_seqs + 2 + num_seqs * width


def unpack(packed: jax.Array, num_tokens: int, num_seqs: int, width: int):
    """packed i32[packed_size] → (token_ids, positions, logits_indices, AttentionMetadata)."""
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs, 1,
             num_seqs * width]
    offsets = np.cumsum([0] + sizes)
    part = [packed[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
    meta = AttentionMetadata(
        slot_mapping=part[2], kv_lens=part[4], block_tables=part[7].reshape(num_seqs, width),
        query_start_loc=part[3], num_seqs=part[6][0])
    return part[0], part[1], part[5], meta


def dummy_metadata(num_tokens: int, num_seqs: int, max_blocks: int) -> AttentionMetadata:
    """All-padding metadata (for init and shape tracing)."""
    return AttentionMetadata(
        slot_mapping=jnp.full((num_tokens,), -1, jnp.int32),
        kv_lens=jnp.zeros((num_seqs,), jnp.int32),
        block_tables=jnp.zeros((num_seqs, max_blocks), jnp.int32),
        query_start_loc=jnp.zeros((num_seqs + 1,), jnp.int32),
        num_seqs=jnp.zeros((), jnp.int32))


class InputBuilder:
    """Fills the packed int32 buffer for one step from the scheduler's decisions.

    Buffers are allocated once per bucket and reused, so a step costs a few
    numpy slice assignments per sequence and no allocation.
    """

    def __init__(self, block_size: int, max_blocks_per_seq: int) -> None:
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self._buffers: dict[tuple[int, int], np.ndarray] = {}

    def build(self, seqs_and_counts, num_tokens: int, num_seqs: int) -> np.ndarray:
        """seqs_and_counts: [(Sequence, num_new_tokens)] → packed i32 buffer for (T, S)."""
        T, S, W, bs = num_tokens, num_seqs, self.width, self.block_size
        key = (T, S)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = np.zeros(packed_size(T, S, W), np.int32)
        tok, pos, slot = buf[0:T], buf[T:2 * T], buf[2 * T:3 * T]
        o = 3 * T
        qsl = buf[o:o + S + 1]
        kvl = buf[o + S + 1:o + 2 * S + 1]
        lidx = buf[o + 2 * S + 1:o + 3 * S + 1]
        nseq = buf[o + 3 * S + 1:o + 3 * S + 2]
        tables = buf[o + 3 * S + 2:].reshape(S, W)

        tok[:] = 0
        pos[:] = 0
        slot[:] = -1
        kvl[:] = 0
        lidx[:] = 0
        start = 0
        for i, (seq, n) in enumerate(seqs_and_counts):
            first = seq.num_computed_tokens
            end = start + n
            tok[start:end] = seq.token_ids[first:first + n]
            p = np.arange(first, first + n, dtype=np.int32)
            pos[start:end] = p
            table = seq.block_table
            blocks = np.asarray(table, np.int32)
            slot[start:end] = blocks[p // bs] * bs + p % bs
            qsl[i] = start
            kvl[i] = first + n
            lidx[i] = end - 1
            tables[i, :len(table)] = blocks
            start = end
        count = len(seqs_and_counts)
        qsl[count:] = start
        nseq[0] = count
        return buf
