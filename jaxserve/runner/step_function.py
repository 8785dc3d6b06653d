"""The function every bucket compiles: one forward over the flat token axis, then sampling."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.lora.stacks import with_lora
from jaxserve.models.tracing import apply_model
from jaxserve.runner.penalty_state import PenaltyHistory, count_emitted
from jaxserve.runner.prompt_logprobs import PromptLogprobsOutput, prompt_logprobs
from jaxserve.runner.sampler import SamplerOutput, sample
from jaxserve.runner.sampling_tensors import SamplingTensors
from jaxserve.runner.spec_verify import last_emitted, sample_with_drafts
from jaxserve.step_inputs import StepLayout, resolve_token_ids

# What a dispatched step leaves on the device: the samples, and the prompt logprobs (None in
# buckets without prompt-logprobs slots).
# With speculative decoding the samples are [S * (k+1)] and come with num_emitted [S].
StepOutputs = tuple[tuple[SamplerOutput, jax.Array | None], PromptLogprobsOutput | None]


def step(params, k_cache, v_cache, last_tokens, penalty_state, packed, bias_token_ids,
         bias_values, grammar_bitmask, lora_stacks=None, stage_input=None, *, model: Any,
         model_constants,
         layout: StepLayout, num_top_logprobs: int, num_spec_tokens: int = 0,
         num_spec_rows: int = 0, logits_shardings: tuple = ()):
    """One engine step: forward over the flat token axis, then sample each row's next token
    (and the prompt logprobs of the positions that ask, when the bucket has slots for them).

    last_tokens: i32[R + 1], the latest sample of every persistent row (donated, updated).
    penalty_state: the rows' penalty history (runner/penalty_state.py; donated, updated
    with the tokens the rows marked ``penalty_counted`` emit).
    grammar_bitmask: i32[S, ceil(V/32)], allowed tokens per row (all ones: unconstrained).
    num_spec_tokens (k > 0: speculative decoding on): the sampler's outputs are [S * (k+1)]
    and ``num_emitted`` [S] says how many tokens each row emits (jaxserve/spec_decode).
    lora_stacks: the adapter slots (jaxserve/lora/stacks.py), None with LoRA off (then the
    step has no LoRA input or work at all).
    stage_input: the last pipeline stage's input, the previous stage's hidden states [T, H]
    (runner/pipeline_runner.py); None: the model starts from the token ids.
    """
    f = layout.unpack(packed)
    if lora_stacks is not None:
        params = with_lora(params, lora_stacks)
    token_ids = resolve_token_ids(f["token_ids"], last_tokens)
    model_input = token_ids if stage_input is None else stage_input
    hidden, k_cache, v_cache = apply_model(model, params, model_input, f["positions"],
                                           layout.metadata(f), k_cache, v_cache, model_constants)

    def logits_of(rows):
        logits = apply_model(model, params, rows, method="logits")
        for sharding in logits_shardings:   # tensor parallel: keep the lm_head local (logits
            logits = jax.lax.with_sharding_constraint(logits, sharding)   # split on vocab),
        return logits                                                      # then gather

    last = f["logits_indices"]
    num_seqs = layout.num_seqs
    # The whole penalty history is in the tables: every token sampled before this step was
    # added to them by its own step.
    history = PenaltyHistory(f["batch_rows"], penalty_state)
    sampling = SamplingTensors(
        temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"], min_p=f["min_p"],
        presence_penalty=f["presence_penalty"], frequency_penalty=f["frequency_penalty"],
        repetition_penalty=f["repetition_penalty"], seeds=f["seeds"],
        step_index=f["kv_lens"] - f["num_prompt_tokens"], num_logprobs=f["num_logprobs"],
        penalty_token_ids=jnp.zeros((num_seqs, 0), jnp.int32),
        num_prompt_tokens=f["num_prompt_tokens"], bias_token_ids=bias_token_ids,
        bias_values=bias_values, newest_token_ids=jnp.full(num_seqs, -1, jnp.int32))
    num_emitted = None
    if num_spec_tokens:
        out, num_emitted = sample_with_drafts(
            hidden, logits_of, token_ids, last, f["num_drafts"], sampling, grammar_bitmask,
            num_spec_tokens=num_spec_tokens, num_spec_rows=num_spec_rows,
            num_top_logprobs=num_top_logprobs, penalty_history=history)
        newest = last_emitted(out, num_emitted)
        emitted = out.next_tokens.reshape(num_seqs, num_spec_tokens + 1)
        counted = jnp.arange(num_spec_tokens + 1)[None, :] < num_emitted[:, None]
    else:
        out = sample(logits_of(hidden[last]), sampling, num_top_logprobs,
                     grammar_bitmask=grammar_bitmask, penalty_history=history)
        newest = out.next_tokens
        emitted, counted = newest[:, None], jnp.ones((num_seqs, 1), jnp.bool_)
    last_tokens = last_tokens.at[f["batch_rows"]].set(newest, mode="drop")
    penalty_state = count_emitted(penalty_state, f["batch_rows"], emitted,
                                  counted & (f["penalty_counted"][:, None] > 0))
    prompt_out = None
    if layout.num_prompt_logprobs:
        prompt_out = prompt_logprobs(logits_of, hidden, f["prompt_logprobs_indices"],
                                     f["prompt_logprobs_targets"], num_top_logprobs)
    return k_cache, v_cache, last_tokens, penalty_state, (out, num_emitted), prompt_out


def stage_forward(params, k_cache, v_cache, last_tokens, packed, stage_input=None,
                  lora_stacks=None, *, model: Any, model_constants, layout: StepLayout):
    """A pipeline stage before the last (runner/pipeline_runner.py): its layers over the flat
    token axis → (caches, hidden states [T, H]). The first stage starts from the token ids
    (``last_tokens``: the decodes' previous samples, copied from the last stage), the others
    from ``stage_input``, the previous stage's hidden states. lora_stacks: this stage's
    adapter slots (its layers only), None with LoRA off."""
    f = layout.unpack(packed)
    if lora_stacks is not None:
        params = with_lora(params, lora_stacks)
    model_input = resolve_token_ids(f["token_ids"], last_tokens) if stage_input is None \
        else stage_input
    hidden, k_cache, v_cache = apply_model(model, params, model_input, f["positions"],
                                           layout.metadata(f), k_cache, v_cache, model_constants)
    return k_cache, v_cache, hidden
