"""Per-step model inputs: one int32 buffer, filled in numpy, sent with one transfer.

Layout of the packed buffer for a (T, S) bucket with block-table width W (float32
fields travel as their int32 bit patterns, seeds as uint32 bits):

  token_ids[T] positions[T] slot_mapping[T]
  query_start_loc[S+1] kv_lens[S] logits_indices[S] batch_rows[S] num_seqs[1] num_drafts[S]
  penalty_counted[S]
  top_k[S] seeds[S] num_logprobs[S] num_prompt_tokens[S]
  temperature[S] top_p[S] min_p[S] presence_penalty[S] frequency_penalty[S]
  repetition_penalty[S]
  block_tables[S*W]
  prompt_logprobs_indices[P] prompt_logprobs_targets[P]
  lora_slots[T]   (only with LoRA on: each token's adapter slot, 0 = base model)

P = min(T, prompt_logprobs_cap) prompt positions per step may ask for prompt logprobs:
``prompt_logprobs_indices[p]`` is a flat token index whose logits predict the prompt token
``prompt_logprobs_targets[p]`` (-1: an unused slot). The scheduler caps the chunks of
requests that ask so that a step never needs more than P.

``num_drafts[s]``: draft tokens of row s this step (speculative decoding): its query chunk
is its newest token then the drafts, and ``logits_indices[s]`` is its last draft.

``penalty_counted[s]``: 1 where row s samples and uses a penalty: the step adds the tokens
it emits to the row's device-resident penalty history (jaxserve/runner/penalty_state.py).

``token_ids[t] < 0`` means "the token sampled last step for persistent row -1 - t":
with async scheduling the host does not know it yet, so the step takes it from the
device-resident ``last_tokens`` array (`resolve_token_ids`). `unpack` slices the
buffer apart inside the jit with static offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

INT_FIELDS = ("top_k", "seeds", "num_logprobs", "num_prompt_tokens")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
FLOAT_NEUTRAL = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)   # padding rows: greedy, no filters


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    slot_mapping: jax.Array     # i32[T], -1 for padding tokens
    kv_lens: jax.Array          # i32[S], cache length after this step (0 for padding)
    block_tables: jax.Array     # i32[S, W]
    query_start_loc: jax.Array  # i32[S+1]
    num_seqs: jax.Array         # i32 scalar
    lora_slots: jax.Array | None = None   # i32[T]: each token's LoRA slot (None: LoRA off)


class StepLayout:
    """Offsets of every field in the packed buffer of bucket (T, S) with table width W."""

    def __init__(self, num_tokens: int, num_seqs: int, width: int,
                 prompt_logprobs_cap: int = 0, lora: bool = False) -> None:
        T, S = num_tokens, num_seqs
        P = min(T, prompt_logprobs_cap)
        sizes = {"token_ids": T, "positions": T, "slot_mapping": T, "query_start_loc": S + 1,
                 "kv_lens": S, "logits_indices": S, "batch_rows": S, "num_seqs": 1,
                 "num_drafts": S, "penalty_counted": S,
                 **{name: S for name in INT_FIELDS + FLOAT_FIELDS},
                 "block_tables": S * width,
                 "prompt_logprobs_indices": P, "prompt_logprobs_targets": P,
                 "lora_slots": T if lora else 0}
        self.num_tokens, self.num_seqs, self.width = T, S, width
        self.lora = lora
        self.num_prompt_logprobs = P
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            self.offsets[name] = (start, start + size)
            start += size
        self.size = start

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Writable numpy views of each field (float fields as float32 views)."""
        views = {name: buf[a:b] for name, (a, b) in self.offsets.items()}
        for name in FLOAT_FIELDS:
            views[name] = views[name].view(np.float32)
        views["seeds"] = views["seeds"].view(np.uint32)
        views["block_tables"] = views["block_tables"].reshape(self.num_seqs, self.width)
        return views

    def unpack(self, packed: jax.Array) -> dict[str, jax.Array]:
        """Inside the jit: packed i32[size] -> named fields (floats and seeds bit-cast)."""
        fields = {name: packed[a:b] for name, (a, b) in self.offsets.items()}
        for name in FLOAT_FIELDS:
            fields[name] = jax.lax.bitcast_convert_type(fields[name], jnp.float32)
        fields["seeds"] = jax.lax.bitcast_convert_type(fields["seeds"], jnp.uint32)
        fields["block_tables"] = fields["block_tables"].reshape(self.num_seqs, self.width)
        fields["num_seqs"] = fields["num_seqs"][0]
        return fields

    def metadata(self, fields: dict[str, jax.Array]) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=fields["slot_mapping"], kv_lens=fields["kv_lens"],
                                 block_tables=fields["block_tables"],
                                 query_start_loc=fields["query_start_loc"],
                                 num_seqs=fields["num_seqs"],
                                 lora_slots=fields["lora_slots"] if self.lora else None)

    def empty(self, padding_row: int) -> np.ndarray:
        """An all-padding buffer (no live sequence): warm-up and idle followers."""
        buf = np.zeros(self.size, np.int32)
        views = self.views(buf)
        views["slot_mapping"][:] = -1
        views["batch_rows"][:] = padding_row
        views["num_logprobs"][:] = -1
        views["prompt_logprobs_targets"][:] = -1
        for name, value in zip(FLOAT_FIELDS, FLOAT_NEUTRAL):
            views[name][:] = value
        return buf


def resolve_token_ids(token_ids: jax.Array, last_tokens: jax.Array) -> jax.Array:
    """Replace "-1 - row" entries by the token the previous step sampled for that row."""
    from_device = token_ids < 0
    rows = jnp.where(from_device, -1 - token_ids, 0)
    return jnp.where(from_device, last_tokens[rows], token_ids)
