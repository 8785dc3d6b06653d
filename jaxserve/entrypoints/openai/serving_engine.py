"""What every OpenAI endpoint shares: model names, limits, sampling params, submitting requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxserve.entrypoints.openai.errors import APIError, engine_error
from jaxserve.entrypoints.openai.protocol import SamplingFields
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("jaxserve.requests")

_TOKENIZE_INLINE_CHARS = 8192      # longer texts are tokenized off the event loop


class OpenAIServing:
    """Model names, limits and helpers every OpenAI endpoint uses."""

    log_requests = True     # one INFO line per admitted request (--disable-log-requests)

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        # LoRA adapters served by name (jaxserve/lora/registry.py); None: LoRA off.
        self.lora_registry = getattr(engine.engine, "lora_registry", None)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = len(self.tokenizer)
        model_config = engine.config.model_config
        self.max_logprobs = model_config.max_logprobs
        self.chat_template = model_config.chat_template

    # -- checks ----------------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The name to report; raises 404 for a model this server does not serve."""
        if requested is None or requested in self.served_model_names:
            return requested or self.served_model_names[0]
        if self.lora_for(requested) is not None:
            return requested
        raise APIError(f"The model `{requested}` does not exist.", 404, param="model",
                       code="model_not_found")

    def lora_for(self, model: str) -> Any:
        """The LoRARequest served as ``model`` (None: the base model)."""
        if self.lora_registry is None or model in self.served_model_names:
            return None
        return self.lora_registry.lookup(model)

    def check_engine(self) -> None:
        if not self.engine.is_healthy:
            raise APIError("the engine is not running", 503, "service_unavailable",
                           code="engine_dead")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= _TOKENIZE_INLINE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: list(
            self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"token id(s) {bad[:5]} out of range [0, {self.vocab_size})",
                           param=param)

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None,
                           input_name: str = "messages", allow_zero: bool = False) -> int:
        """Check prompt + max_tokens against max_model_len (vLLM's wording); return max_tokens.
        `input_name` is what the client sent the input as: "messages" (chat) or "prompt".
        allow_zero: 0 means prefill only (echo of the prompt and its logprobs)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt_tokens} input tokens. Please reduce the length of the input "
                f"{input_name}.", param=input_name, code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if max_tokens < 1 and not (allow_zero and max_tokens == 0):
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}.",
                           param="max_tokens")
        if num_prompt_tokens + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"{input_name}, {max_tokens} in the completion). Please reduce the length of "
                f"the {input_name} or completion.", param="max_tokens",
                code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, request: SamplingFields, max_tokens: int,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        stream: bool = False) -> SamplingParams:
        """The request's SamplingParams: outputs as deltas when streaming, else only the
        final one (vLLM's RequestOutputKind). The engine's limits are checked once, when
        the request is submitted (`start_requests`)."""
        kwargs = request.sampling_kwargs()
        try:
            return SamplingParams(
                max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs, **kwargs,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc)) from None

    # -- running ---------------------------------------------------------------------------------
    async def start_requests(self, prefix: str, prompts: list[list[int]],
                             params: list[SamplingParams], lora_request: Any = None
                             ) -> list[AsyncIterator]:
        """Submit one engine request per prompt; all accepted, or none (then raise).

        Every prompt is validated and queued before waiting once for the engine to accept
        them all, so all start in the same engine step. A LoRA adapter's weights are loaded
        here, off the engine thread, when the host LRU no longer holds them."""
        self.check_engine()
        streams = []
        extra = {}
        if lora_request is not None:
            try:
                extra["lora_request"] = await asyncio.to_thread(self.lora_registry.get,
                                                                lora_request)
            except ValueError as exc:
                raise APIError(str(exc), param="model") from None
        try:
            for i, (token_ids, sampling_params) in enumerate(zip(prompts, params)):
                request_id = f"{prefix}-{i}"
                if self.log_requests:
                    request_logger.info("Received request %s: %d prompt tokens, %r",
                                        request_id, len(token_ids), sampling_params)
                streams.append(self.engine.submit(request_id, None, sampling_params,
                                                  prompt_token_ids=token_ids, **extra))
            await self.engine.wait_accepted(streams)
        except BaseException as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(exc, (ValueError, EngineDeadError)):
                raise engine_error(exc) from None
            raise
        return [self.engine.stream_outputs(stream) for stream in streams]

