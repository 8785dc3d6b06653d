"""Validation at the edge: a prompt and its SamplingParams become an `EngineRequest`, once.

Everything a request's data can get wrong (prompt token ids out of the vocabulary, a prompt
that leaves no room to generate, limits that depend on the engine) is a ValueError here,
before the request reaches the engine thread; the engine trusts what it is handed.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.engine.engine_io import EngineRequest
from jaxserve.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, max_logprobs: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = len(tokenizer)

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
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not isinstance(prompt_token_ids, list) or not all(
                type(t) is int for t in prompt_token_ids):
            prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.check_prompt(prompt_token_ids)
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
