"""Requests in: every rule a request's data must meet, and the validated `EngineRequest`.

`RequestLimits` is the one owner of the rules that depend on the model: token ids inside the
vocabulary, a prompt that leaves room to generate, prompt + max_tokens within the context,
logprobs within max_logprobs. `InputProcessor` (vLLM's name) applies them to every request
before it reaches an engine core, for `LLM` and the server alike; the OpenAI server also asks
`RequestLimits` directly, earlier, so its 400s carry the API's `param` and wording.

The context-length rule has two wordings, both vLLM's: the API's ("This model's maximum
context length is ...", with OpenAI's `context_length_exceeded` code) and the engine's
("The decoder prompt (length N) is longer than the maximum model length of M"), which
`LLM.generate` raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.engine_io import EngineRequest
from jaxserve.sampling_params import SamplingParams


class RequestLimitError(ValueError):
    """A request the model can never run. ``param`` names the request field at fault (the
    API's `param`), ``code`` is OpenAI's error code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The model's limits on a request: vocabulary, context length, logprobs."""
    vocab_size: int
    max_model_len: int
    max_logprobs: int

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        """Every id inside [0, vocab_size); RequestLimitError naming the first few outside."""
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestLimitError(f"token id(s) {bad[:5]} out of range [0, {vocab})", param)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """A prompt the engine can run: not empty, ids in the vocabulary, room for one
        generated token (the engine's wording)."""
        if not prompt_token_ids:
            raise RequestLimitError("the prompt is empty (0 tokens)", "prompt")
        self.check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestLimitError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {self.max_model_len}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens plus one generated token.", "prompt",
                "context_length_exceeded")

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None,
                           input_name: str = "messages", allow_zero: bool = False) -> int:
        """Check prompt + max_tokens against max_model_len (the API's wording); the
        request's max_tokens (None: what the context leaves). `input_name` is what the client
        sent the input as: "messages" (chat) or "prompt". allow_zero: 0 means prefill only
        (echo of the prompt and its logprobs)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise RequestLimitError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens. Please reduce the length of the input "
                f"{input_name}.", input_name, "context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if max_tokens < 1 and not (allow_zero and max_tokens == 0):
            raise RequestLimitError(f"max_tokens must be at least 1, got {max_tokens}.",
                                    "max_tokens")
        if num_prompt_tokens + max_tokens > limit:
            raise RequestLimitError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"{input_name}, {max_tokens} in the completion). Please reduce the length of "
                f"the {input_name} or completion.", "max_tokens", "context_length_exceeded")
        return max_tokens

    def check_params(self, params: SamplingParams) -> None:
        """The SamplingParams limits that depend on the model (ValueError)."""
        params.verify(self.max_logprobs, self.max_model_len, self.vocab_size)


class InputProcessor:
    """A prompt and its SamplingParams → an `EngineRequest`, validated once."""

    def __init__(self, tokenizer: Any, limits: RequestLimits) -> None:
        """tokenizer: None under skip_tokenizer_init (prompts must be token ids)."""
        self.tokenizer = tokenizer
        self.limits = limits

    @classmethod
    def for_core(cls, core: Any) -> InputProcessor:
        """The input processor of an engine core (an `EngineCoreInterface`): its tokenizer's
        vocabulary bounds prompt ids, or the model's when no tokenizer is loaded."""
        tokenizer = core.tokenizer
        vocab_size = len(tokenizer) if tokenizer is not None else core.vocab_size
        return cls(tokenizer, RequestLimits(vocab_size, core.max_model_len,
                                            core.config.model_config.max_logprobs))

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
        self.limits.check_prompt(prompt_token_ids)
        if self.tokenizer is None and params.stop:
            raise ValueError(f"stop strings {params.stop!r} need the text, and "
                             "`skip_tokenizer_init` is True: use stop_token_ids")
        self.limits.check_params(params)
        return EngineRequest(request_id, prompt, prompt_token_ids, params,
                             arrival_time or time.time(), lora_request)
