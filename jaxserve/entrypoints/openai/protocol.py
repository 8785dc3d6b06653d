"""OpenAI API request models (pydantic) and response shapes, with vLLM's extra fields.

Requests are validated models. Unknown fields are accepted (clients such as LangChain
send vendor fields) and logged per request at debug level, as vLLM does. Fields we
*recognise* (OpenAI's or vLLM's) but do not implement are a 400 naming the field when
they are set to anything but their "off" value: a client that asks for beam search or
audio must not get a 200 that silently lacks it.
Responses are plain dicts built by the functions at the bottom, in OpenAI's
field names: streaming sends one per token, and a dict with `json.dumps` is
the cheapest correct thing to send.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

MAX_N = 128                  # OpenAI's own limit on `n`

# Recognised request fields (OpenAI's or vLLM's) that jaxserve does not implement, with
# what to say about each. Sending one with a value other than its "off" value (null,
# false, 0, "", [] or {}) is a 400 that names it.
_NOT_IMPLEMENTED_COMMON = {
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "length_penalty applies to beam search, which is not implemented",
    "allowed_token_ids": "allowed_token_ids is not implemented; use logit_bias",
    "bad_words": "bad_words is not implemented; use logit_bias",
    "logits_processors": "custom logits processors are not supported",
    "priority": "priority scheduling is not implemented (the scheduler is FCFS)",
    "cache_salt": "cache_salt is not implemented",
    "prompt_embeds": "prompt embeddings are not supported",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not implemented",
    "return_token_ids": "return_token_ids is not implemented",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not implemented",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "structural_tag": "structural_tag is not supported",
}
_NOT_IMPLEMENTED_CHAT = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "documents": "documents (RAG chat templates) are not supported",
    "media_io_kwargs": "multimodal inputs are not supported",
    "echo": "echo on chat completions is not implemented",
}


def _is_off(value: Any) -> bool:
    return value is None or value is False or (
        not isinstance(value, bool) and value in (0, "", [], {}))


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields (debug-logged per request); refuses recognised ones we don't
    implement (`not_implemented`, name -> reason) unless they are off."""

    model_config = ConfigDict(extra="allow")
    not_implemented: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _check_extra_fields(self) -> OpenAIBaseModel:
        extra = self.model_extra or {}
        if not extra:
            return self
        refused = [name for name in extra
                   if name in self.not_implemented and not _is_off(extra[name])]
        if refused:
            raise ValueError("; ".join(
                f"`{name}` is not supported by this server: {self.not_implemented[name]}"
                for name in refused))
        unknown = [name for name in extra if name not in self.not_implemented]
        if unknown:
            logger.debug("%s: ignoring unknown field(s) %s", type(self).__name__,
                         ", ".join(sorted(unknown)))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    not_implemented: ClassVar[dict[str, str]] = _NOT_IMPLEMENTED_COMMON

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    best_of: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # legacy guided_* fields (jaxserve/entrypoints/openai/structured_request.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    prompt_logprobs: int | None = None     # vLLM: top-N logprobs of every prompt token

    @model_validator(mode="after")
    def _check_prompt_logprobs(self) -> SamplingFields:
        # vLLM's rules and words; -1 (the whole vocabulary) is recognised but not implemented.
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
            if self.prompt_logprobs == -1:
                raise ValueError("`prompt_logprobs` of -1 (the whole vocabulary) is not "
                                 "supported; ask for at most max_logprobs")
            if self.prompt_logprobs < 0:
                raise ValueError(f"`prompt_logprobs` must be a positive value or -1, got "
                                 f"{self.prompt_logprobs}.")
        return self

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams kwargs for the fields every endpoint shares (unset ones omitted)."""
        kwargs: dict[str, Any] = {
            "n": self.n, "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias, "seed": self.seed}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "best_of"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_in_stream(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage so far on every chunk."""
        return bool(self.include_usage_in_stream and
                    self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is text, texts, token ids, or lists of token ids."""

    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p
                                                 for p in self.prompt):
            raise ValueError("prompt token id lists must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(OpenAIBaseModel):
    type: str = "text"
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported: this "
                             f"server serves text-only models")
        return self


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None          # assistant turns that called tools
    tool_call_id: str | None = None                   # tool turns: which call they answer


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    not_implemented: ClassVar[dict[str, str]] = {**_NOT_IMPLEMENTED_COMMON,
                                                 **_NOT_IMPLEMENTED_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (jaxserve/entrypoints/openai/tool_calls.py), and the legacy functions API.
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    functions: list[FunctionDefinition] | None = None
    function_call: str | dict[str, Any] | None = None

    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.modalities and set(self.modalities) - {"text"}:
            raise ValueError(f"modalities {self.modalities} are not supported (text only)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        return self

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        out = []
        for message in self.messages:
            item = message.model_dump(exclude_none=True)
            if isinstance(message.content, list):
                item["content"] = [p if isinstance(p, str) else p.model_dump(exclude_none=True)
                                   for p in message.content]
            for call in item.get("tool_calls", ()):
                # Templates index into the arguments (vLLM hands them a dict, too).
                arguments = call["function"].get("arguments")
                if isinstance(arguments, str):
                    try:
                        call["function"]["arguments"] = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass
            out.append(item)
        return out


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either `prompt` (text) or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# -- responses (plain dicts, OpenAI's field names) ------------------------------------------------
def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_response(request_id: str, model: str, choices: list[dict], usage: dict | None,
                        created: int | None = None, chunk: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": choices}
    if not chunk or usage is not None:
        body["usage"] = usage
    return body


def chat_response(request_id: str, model: str, choices: list[dict], usage: dict | None,
                  created: int | None = None, chunk: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": choices}
    if not chunk or usage is not None:
        body["usage"] = usage
    return body
