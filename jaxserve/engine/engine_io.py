"""What crosses the engine thread's boundary: requests in, token deltas out (no text).

The engine core (`LLMEngine.step_core`) reports, per request that changed, only what is new
since its last report: token ids and their numeric logprobs. Text, stop strings and logprob
token text are built on the front end's side (jaxserve/engine/request_text.py), so the
engine thread's cost per step does not grow with the tokens a request has produced.

Requests are validated at the edge (`InputProcessor`, the end of this file): everything a
request's data can get wrong (prompt token ids out of the vocabulary, a prompt that leaves
no room to generate, limits that depend on the engine) is a ValueError there, before the
request reaches the engine thread; the engine trusts what it is handed.
"""

from __future__ import annotations

import time
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


# -- requests in: validation at the edge, once ---------------------------------------------------
class InputProcessor:
    """A prompt and its SamplingParams → an `EngineRequest`, validated once."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_logprobs: int,
                 vocab_size: int | None = None) -> None:
        """tokenizer: None under skip_tokenizer_init (prompts must be token ids, checked
        against the model's `vocab_size`)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        if tokenizer is None and vocab_size is None:
            raise ValueError("without a tokenizer the model's vocab_size bounds prompt ids")
        self.vocab_size = len(tokenizer) if tokenizer is not None else vocab_size

    def process(self, request_id: str, prompt: str | list[int] | None,
                params: SamplingParams | None = None, *,
                prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                lora_request: Any = None) -> EngineRequest:
        """Tokenize (a text prompt) and check; raises ValueError naming what is wrong."""
        params = params or SamplingParams()
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError(f"You cannot pass text prompts when `skip_tokenizer_init` is "
                                 f"True: no tokenizer is loaded to encode {prompt[:40]!r}; "
                                 "pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not isinstance(prompt_token_ids, list) or not all(
                type(t) is int for t in prompt_token_ids):
            prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.check_prompt(prompt_token_ids)
        if self.tokenizer is None and params.stop:
            raise ValueError(f"stop strings {params.stop!r} need the text, and "
                             "`skip_tokenizer_init` is True: use stop_token_ids")
        params.verify(self.max_logprobs, self.max_model_len, self.vocab_size)
        return EngineRequest(request_id, prompt, prompt_token_ids, params,
                             arrival_time or time.time(), lora_request)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of range [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {self.max_model_len}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens plus one generated token.")
