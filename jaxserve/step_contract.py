"""The seam between the scheduler and the model runner: what one step asks, what it returns.

The scheduler knows sequences and blocks; the runner knows tensors. Every step the
scheduler hands the runner a `SchedulerOutput` — *diffs* against what the runner already
holds (new sequences, new block ids, finished and preempted ids) plus this step's token
counts — and the runner answers with a `RunnerOutput`. The runner keeps its own persistent
batch (jaxserve/runner/input_batch.py) and never reads a `Sequence`.

Rows are in *batch order*: ``seq_ids[i]`` is row i of the step, and row i of every
per-row list here and of the `RunnerOutput` belongs to it.

``draft_token_ids`` carries speculative decoding's drafts, ``grammar_bitmask`` structured
outputs' masks; ``NewSeqData.adapter_slot`` and ``lora_loads`` multi-LoRA's slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewSeqData:
    """A sequence the runner has no row for: just admitted, or resumed after preemption."""
    seq_id: int
    token_ids: list[int]            # every token known now: the prompt (+ outputs when resumed)
    num_prompt_tokens: int
    block_ids: list[int]            # its whole block table
    num_computed_tokens: int        # tokens already in the KV cache (prefix-cache hit)
    sampling_params: SamplingParams
    seed: int                       # this sequence's sampling seed (fixed at arrival)
    adapter_slot: int = 0           # LoRA slot (0 = base model; jaxserve/lora/slots.py)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, as diffs against the runner's persistent batch."""
    seq_ids: list[int] = field(default_factory=list)               # batch order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per row
    num_computed_tokens: list[int] = field(default_factory=list)   # per row, before the step
    # Per row: the step ends at the sequence's newest token, so its sample is a new token
    # (False for a prefill chunk that stops short of the prompt's end).
    is_sampling: list[bool] = field(default_factory=list)
    new_seqs: list[NewSeqData] = field(default_factory=list)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)   # running seqs only
    # Running seqs whose block tables shrank since the last step (speculative decoding gave
    # back blocks that held only rejected drafts): seq id -> new length, applied before
    # new_block_ids.
    block_table_lengths: dict[int, int] = field(default_factory=dict)
    # Sequences whose rows the runner drops before this step: finished or aborted since the
    # last step, and preempted in this one (a preempted sequence returns as a NewSeqData).
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_decode_tokens: int = 0      # rows that feed back one sampled token (the rest: prompt)
    # Speculative decoding: seq id -> the draft tokens scheduled after its newest token (the
    # row's num_scheduled_tokens counts them); rows not here have none.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None       # i32[rows, ceil(V / 32)], batch order
    # LoRA: slot -> the adapter weights (jaxserve/lora/peft_loader.LoRAWeights) the runner
    # writes into that device slot before this step (the scheduler just gave it the slot).
    lora_loads: dict[int, Any] = field(default_factory=dict)
    # Pipeline parallel with micro-batches in flight (engine/micro_batches.py): which one this
    # step runs (the runner keeps each one's device-side last tokens apart).
    micro_batch: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids


@dataclass(slots=True)
class SampledLogprobs:
    """Logprobs of one step's rows (batch order), from the raw logits."""
    sampled_logprobs: np.ndarray    # f32[rows], of the sampled token
    sampled_ranks: np.ndarray       # i32[rows], 1 + tokens with a higher logprob (whole vocab)
    top_token_ids: np.ndarray       # i32[rows, K]
    top_logprobs: np.ndarray        # f32[rows, K]


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Logprobs of consecutive prompt tokens of one row, from this step's prefill logits.

    Entry i is prompt token ``first + i`` (predicted by the logits at position first + i - 1),
    so ``first >= 1``: vLLM's prompt_logprobs[0] (the first token) is always None.
    """
    first: int
    token_ids: np.ndarray           # i32[n], the actual prompt tokens
    logprobs: np.ndarray            # f32[n], of the actual tokens
    ranks: np.ndarray               # i32[n], 1 + tokens with a higher logprob (whole vocab)
    top_token_ids: np.ndarray       # i32[n, K]
    top_logprobs: np.ndarray        # f32[n, K]


@dataclass(slots=True)
class RunnerOutput:
    """What one step produced, rows in the SchedulerOutput's batch order."""
    sampled_token_ids: list[int]    # per row; meaningless where is_sampling is False
    logprobs: SampledLogprobs | None = None    # None when no row asked for logprobs
    # Batch row -> its prompt logprobs of this step (rows whose request asks, in the prompt).
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    # Speculative decoding on: per row, every token it emits this step (accepted drafts, then
    # the correction or bonus token; sampled_token_ids[row] is the first). None when off.
    emitted_token_ids: list[list[int]] | None = None
    # Logprobs rows per batch row: token j of row r is logprobs row r * stride + j.
    logprobs_stride: int = 1
