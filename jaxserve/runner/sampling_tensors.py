"""Per-step sampling inputs: the pytree the jitted sampler reads.

The runner builds it inside the jitted step from the packed step buffer and the bias
tables (jaxserve/runner/input_batch.py fills them on the host); its penalty history is
device-resident (jaxserve/runner/penalty_state.py, handed to the sampler beside these),
so ``penalty_token_ids`` is [S, 0] there. Tests and benchmarks build it directly from
numpy arrays, the history as token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingTensors:
    """Sampling inputs of one step; S = padded number of sequences. Padding rows are greedy."""

    temperature: np.ndarray         # f32[S]; < 1e-5 = greedy
    top_k: np.ndarray               # i32[S]; 0 = off
    top_p: np.ndarray               # f32[S]; 1 = off
    min_p: np.ndarray               # f32[S]; 0 = off
    presence_penalty: np.ndarray    # f32[S]
    frequency_penalty: np.ndarray   # f32[S]
    repetition_penalty: np.ndarray  # f32[S]; 1 = off
    seeds: np.ndarray               # u32[S]; row uniforms = hash(seed, step_index, column)
    step_index: np.ndarray          # i32[S]; number of output tokens so far
    num_logprobs: np.ndarray        # i32[S]; -1 = no logprobs requested, else top-N
    penalty_token_ids: np.ndarray   # i32[S, P]; prompt + output ids, -1 padded (P may be 0)
    num_prompt_tokens: np.ndarray   # i32[S]; positions below this are prompt tokens
    bias_token_ids: np.ndarray      # i32[S, NB]; -1 padded (logit_bias, min_tokens bans)
    bias_values: np.ndarray         # f32[S, NB]; additive, -inf bans
    # Output tokens not in the rest of the history yet, else -1 (speculative verification:
    # the drafts before a position). Penalties count them as output tokens.
    newest_token_ids: np.ndarray    # i32[S] (or [S, n]: also the drafts before a position)
