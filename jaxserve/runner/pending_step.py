"""A dispatched step's device outputs, turned into a `RunnerOutput` when the host asks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.runner.step_function import StepOutputs
from jaxserve.step_contract import (
    PromptLogprobsChunk,
    RunnerOutput,
    SampledLogprobs,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner


class PendingStep:
    """A dispatched step; `result()` waits for its samples and returns a RunnerOutput."""

    def __init__(self, runner: ModelRunner, out: SchedulerOutput, rows: np.ndarray,
                 kv_lens: np.ndarray, device_out: StepOutputs, want_logprobs: bool,
                 prompt_logprobs_rows: tuple[tuple[int, int, int, int], ...] = ()) -> None:
        self._runner, self._out, self._rows, self._kv_lens = runner, out, rows, kv_lens
        (self._sampler_out, self._num_emitted), self._prompt_out = device_out
        self._want_logprobs = want_logprobs
        self._prompt_logprobs_rows = prompt_logprobs_rows
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._result is None:
            n = self._out.num_rows
            width = self._runner.num_spec_tokens + 1     # tokens per row in the outputs
            all_tokens = np.asarray(self._sampler_out.next_tokens)[:n * width]
            logprobs = None
            if self._want_logprobs:
                o = jax.device_get(self._sampler_out)
                logprobs = SampledLogprobs(np.asarray(o.sampled_logprobs)[:n * width],
                                           np.asarray(o.sampled_ranks)[:n * width],
                                           np.asarray(o.top_token_ids)[:n * width],
                                           np.asarray(o.top_logprobs)[:n * width])
            emitted = None
            if self._num_emitted is None:
                tokens = all_tokens.tolist()
                self._runner.batch.record_sampled(self._out.seq_ids, self._rows,
                                                  self._kv_lens, self._out.is_sampling, tokens)
            else:
                grid = all_tokens.reshape(n, width)
                counts = np.asarray(self._num_emitted)[:n]
                tokens = grid[:, 0].tolist()
                emitted = [grid[i, :counts[i]].tolist() for i in range(n)]
                drafts = np.asarray([len(self._out.draft_token_ids.get(s, ()))
                                     for s in self._out.seq_ids], np.int64)
                self._runner.batch.record_emitted(self._out.seq_ids, self._rows,
                                                  self._kv_lens - drafts,
                                                  self._out.is_sampling, grid, counts)
            self._result = RunnerOutput(tokens, logprobs, self._prompt_logprobs(),
                                        emitted_token_ids=emitted, logprobs_stride=width)
            self._sampler_out = self._prompt_out = self._num_emitted = None
        return self._result

    def _prompt_logprobs(self) -> dict[int, PromptLogprobsChunk]:
        if not self._prompt_logprobs_rows:
            return {}
        o = jax.device_get(self._prompt_out)
        batch = self._runner.batch
        chunks = {}
        for i, first, slot, count in self._prompt_logprobs_rows:
            row, end = self._rows[i], slot + count
            chunks[i] = PromptLogprobsChunk(
                first, batch.token_ids[row, first:first + count].copy(),
                np.asarray(o.logprobs[slot:end]), np.asarray(o.ranks[slot:end]),
                np.asarray(o.top_token_ids[slot:end]), np.asarray(o.top_logprobs[slot:end]))
        return chunks

