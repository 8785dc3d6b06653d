"""What crosses the engine thread's boundary: requests in, token deltas out (no text).

The engine core (`EngineCore.step`) reports, per request that changed, only what is new
since its last report: token ids and their numeric logprobs. Text, stop strings and logprob
token text are built on the front end's side (jaxserve/engine/output_processor.py), so the
engine thread's cost per step does not grow with the tokens a request has produced.

Requests are validated at the edge (`InputProcessor`, jaxserve/engine/input_processor.py):
everything a request's data can get wrong (prompt token ids out of the vocabulary, a prompt
that leaves no room to generate, limits that depend on the engine) is a ValueError there,
before the request reaches the engine thread; the engine trusts what it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.outputs import RequestMetrics
from jaxserve.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """A request as the front end hands it to the engine: already tokenized and validated."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lora_request: Any = None


# One position's numeric logprobs: (token id, its logprob, its vocab rank, top-N ids,
# top-N logprobs), the top-N already cut to what the request asked for.
RawLogprobs = tuple[int, float, int, list[int], list[float]]


@dataclass(slots=True)
class SeqDelta:
    """One sequence's news since the engine's last report of it."""
    index: int                                # which of the request's n completions
    new_token_ids: list[int]
    new_logprobs: list[RawLogprobs] | None    # one per new token when logprobs were asked
    finish_reason: str | None = None          # set by the engine: EOS, stop token, length...
    stop_reason: int | None = None            # the stop token id that ended it


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step (or its final report)."""
    request_id: str
    seqs: list[SeqDelta]
    finished: bool                            # every sequence finished (or aborted)
    num_cached_tokens: int
    metrics: RequestMetrics
    # vLLM's prompt_logprobs ([None, entry of prompt token 1, ...]), numeric, sent once
    prompt_logprobs: list[RawLogprobs | None] | None = None
