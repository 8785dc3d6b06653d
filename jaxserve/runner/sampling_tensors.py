"""Per-step sampling inputs: the pytree the jitted sampler reads.

The runner builds it inside the jitted step from the packed step buffer and the
penalty / bias tables (jaxserve/runner/input_batch.py fills them on the host);
tests and benchmarks build it directly from numpy arrays.
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
    penalty_token_ids: np.ndarray   # i32[S, P]; prompt + output ids, -1 padded; P = max_model_len
    num_prompt_tokens: np.ndarray   # i32[S]; positions below this are prompt tokens
    bias_token_ids: np.ndarray      # i32[S, NB]; -1 padded (logit_bias, min_tokens bans)
    bias_values: np.ndarray         # f32[S, NB]; additive, -inf bans
    # The newest output token when it is not in penalty_token_ids yet (async scheduling:
    # the host has not seen it), else -1. Penalties count it as an output token.
    newest_token_ids: np.ndarray    # i32[S] (or [S, n]: also the drafts before a position)
