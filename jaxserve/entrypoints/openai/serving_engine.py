"""What the completion and chat endpoints share: request parsing, validation, errors,
prompt limits, sampling params, logprob formats, disconnect handling, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from jaxserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxserve.entrypoints.openai.protocol import SamplingFields, error_body
from jaxserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("jaxserve.requests")

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

MAX_BODY_BYTES = 32 << 20          # a request body larger than this is refused (400)
_TOKENIZE_INLINE_CHARS = 8192      # longer texts are tokenized off the event loop
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class APIError(Exception):
    """An error to send in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message, status, type, param, code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def engine_error(exc: BaseException) -> APIError:
    """Map an exception from the engine side to an API error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503, "service_unavailable", code="engine_dead")
    return APIError(f"internal error: {exc!r}", 500, "internal_server_error")


async def parse_body(raw_request: Request, model_type: type[ModelT]) -> ModelT:
    """Read and validate a JSON body ourselves, so every failure is a 400 in OpenAI's shape."""
    length = raw_request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(f"request body too large ({length} bytes; the limit is "
                       f"{MAX_BODY_BYTES})")
    chunks, size = [], 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"request body too large (more than {MAX_BODY_BYTES} bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):      # "\ud800" decodes to a string no tokenizer takes
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(f"request body contains an unpaired UTF-16 surrogate: {exc}") \
                from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError | Any) -> APIError:
    errors = exc.errors() if hasattr(exc, "errors") else []
    # Our validators' own messages ("content parts of type 'image_url' are not supported")
    # say what is wrong; the other branches of a union that also failed only bury them.
    ours = [err for err in errors if str(err.get("msg", "")).startswith("Value error, ")]
    if ours:
        errors = [{**err, "msg": err["msg"].removeprefix("Value error, ")} for err in ours]
    parts, param = [], None
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if _field_name(p))
        param = param or loc or None
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return APIError("; ".join(parts) or str(exc), param=param)


_TYPE_NAMES = {"body", "str", "list", "dict", "int", "float", "bool", "none"}


def _field_name(part: Any) -> bool:
    """A location part that names a field or index, not one of pydantic's union branches."""
    if isinstance(part, int):
        return True
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part))) and \
        str(part) not in _TYPE_NAMES and not str(part)[0].isupper()


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
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        kwargs = request.sampling_kwargs()
        try:
            params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs,
                                    structured_outputs=structured_outputs, **kwargs)
            params.verify(self.max_logprobs, self.max_model_len, self.vocab_size)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc)) from None
        return params

    # -- running ---------------------------------------------------------------------------------
    async def start_requests(self, prefix: str, prompts: list[list[int]],
                             params: list[SamplingParams], lora_request: Any = None
                             ) -> list[AsyncIterator]:
        """Submit one engine request per prompt; all accepted, or none (then raise).
        A LoRA adapter's weights are loaded here, off the engine thread, when the host LRU
        no longer holds them."""
        self.check_engine()
        streams, ids = [], []
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
                stream = await self.engine.add_request(request_id, None, sampling_params,
                                                       prompt_token_ids=token_ids, **extra)
                ids.append(request_id)
                streams.append(self.engine.stream_outputs(stream))
        except BaseException as exc:
            for request_id in ids:
                self.engine.abort(request_id)
            if isinstance(exc, (ValueError, EngineDeadError)):
                raise engine_error(exc) from None
            raise
        return streams


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(raw_request: Request, prefix: str, separator: str = "-") -> str:
    """The response id: the client's ``x-request-id`` after ``prefix`` (as vLLM, so the id a
    proxy or client chose shows up in responses and our logs), else a fresh one. An id
    with other characters or over 128 long is not used (it would reach the logs as is)."""
    given = raw_request.headers.get("x-request-id", "")
    if not _CLIENT_ID.fullmatch(given):
        given = uuid.uuid4().hex
    return f"{prefix}{separator}{given}"


async def until_disconnect(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (index of the iterator, item)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return

    async def next_item(stream: AsyncIterator[T]) -> T:
        return await stream.__anext__()

    pending = {asyncio.ensure_future(next_item(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(next_item(streams[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        if pending:     # let cancelled streams finish (and abort) before closing them
            await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def collect_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Drain request streams concurrently; the final RequestOutput of each, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


# -- server-sent events ------------------------------------------------------------------------
def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(engine_error(exc).body())


# -- logprobs in OpenAI's two formats ---------------------------------------------------------
def _token_text(entry: Logprob, token_id: int, tokenizer: Any) -> str:
    if entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def completion_logprobs(output: CompletionOutput, start: int, end: int, text_offset: int,
                        tokenizer: Any) -> dict[str, Any]:
    """Completions format for output tokens [start, end): tokens, token_logprobs,
    top_logprobs (the sampled token plus the top N, token text -> logprob), text_offset."""
    return legacy_logprobs(output.token_ids[start:end], (output.logprobs or [])[start:end],
                           text_offset, tokenizer)


def legacy_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None],
                    text_offset: int, tokenizer: Any) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs of ``token_ids``; a None entry (the first prompt
    token) gives null token_logprobs and top_logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        actual = entry.get(token_id) if entry is not None else None
        text = _token_text(actual, token_id, tokenizer) if actual else \
            tokenizer.decode([token_id])
        tokens.append(text)
        token_logprobs.append(_finite(actual.logprob) if actual else None)
        top_logprobs.append(None if entry is None else {
            _token_text(lp, tid, tokenizer): _finite(lp.logprob) for tid, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def echo_logprobs(prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None,
                  tokenizer: Any) -> dict[str, Any]:
    """Echoed prompt tokens in the completions logprobs format: the first token's logprob is
    null (nothing predicts it), the rest come from the engine's prompt logprobs."""
    entries = prompt_logprobs or [None] * len(prompt_token_ids)
    return legacy_logprobs(prompt_token_ids, entries, 0, tokenizer)


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's `prompt_logprobs` response field: [null, {token id: {logprob, rank,
    decoded_token}}, ...]."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
        for entry in prompt_logprobs]


def _finite(logprob: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 for it."""
    return max(logprob, -9999.0)


def chat_logprobs(output: CompletionOutput, start: int, end: int, num_top: int,
                  tokenizer: Any) -> list[dict[str, Any]]:
    """Chat format: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    content = []
    for token_id, entry in zip(output.token_ids[start:end], (output.logprobs or [])[start:end]):
        sampled = entry.get(token_id)
        text = _token_text(sampled, token_id, tokenizer) if sampled else \
            tokenizer.decode([token_id])
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items()
                         if lp.rank is not None and lp.rank <= num_top), key=lambda x: x[0])
        top = []
        for _, tid, lp in ranked[:num_top]:
            token_text = _token_text(lp, tid, tokenizer)
            top.append({"token": token_text, "logprob": lp.logprob,
                        "bytes": list(token_text.encode("utf-8"))})
        content.append({"token": text, "logprob": sampled.logprob if sampled else None,
                        "bytes": list(text.encode("utf-8")), "top_logprobs": top})
    return content


def reraise_disconnect(exc: BaseException) -> bool:
    """True for exceptions that mean the client went away (nothing left to send)."""
    return isinstance(exc, (ClientGone, ClientDisconnect, asyncio.CancelledError,
                            GeneratorExit))
