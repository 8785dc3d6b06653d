"""The server's routes, one function per job; `api_server.build_app` adds them to the app.

Generation: POST /v1/completions, /v1/chat/completions, /v1/responses (+ GET one stored
response). Models: GET /v1/models, /v1/models/{id}. Tokenizer: POST /tokenize, /detokenize,
GET /tokenizer_info. LoRA: POST /v1/load_lora_adapter, /v1/unload_lora_adapter.
Operations: GET /health, /livez, /readyz, /version, /metrics. Every route reads its JSON body with
`parse_body` (the end of this file), so every bad body is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import jaxserve
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.error_handlers import handle
from jaxserve.entrypoints.openai.errors import APIError, validation_error
from jaxserve.entrypoints.openai.health import health_problem, liveness, readiness
from jaxserve.entrypoints.openai.key_auth import allowed_models, current_grant
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from jaxserve.entrypoints.openai.responses_protocol import ResponsesRequest
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_engine import INLINE_TOKEN_IDS, new_request_id, off_loop_if
from jaxserve.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest,
    OpenAIServingLoRA,
    UnloadLoRAAdapterRequest,
)
from jaxserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxserve.entrypoints.openai.tokenizer_info import tokenizer_info
from jaxserve.loader.tokenizer import decode_releasing_gil
from jaxserve.metrics import CONTENT_TYPE, ServerMetrics


def add_generation_routes(app: FastAPI, completions: OpenAIServingCompletion,
                          chat: OpenAIServingChat, responses: OpenAIServingResponses) -> None:
    """POST /v1/completions, /v1/chat/completions, /v1/responses; GET /v1/responses/{id}."""

    @app.post("/v1/completions")
    @handle
    async def create_completion(raw_request: Request) -> Response:
        """OpenAI completions (text or token-id prompts), streamed or not."""
        completions.check_capacity()         # a full queue refuses before reading the body
        request = await parse_body(raw_request, CompletionRequest)
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/responses")
    @handle
    async def create_response(raw_request: Request) -> Response:
        """OpenAI Responses API (text, function tools, json_schema, reasoning items,
        previous_response_id), streamed or not; served on the chat path."""
        request = await parse_body(raw_request, ResponsesRequest)
        return await responses.create_response(
            request, raw_request, new_request_id("resp", raw_request, "_"))

    @app.get("/v1/responses/{response_id}")
    @handle
    async def retrieve_response(raw_request: Request) -> Response:
        """A stored response (store was not false, within the store's size and age)."""
        return JSONResponse(responses.retrieve(raw_request.path_params["response_id"]))

    @app.post("/v1/chat/completions")
    @handle
    async def create_chat_completion(raw_request: Request) -> Response:
        """OpenAI chat completions, streamed or not."""
        chat.check_capacity()
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.create_chat_completion(request, raw_request)


def add_model_routes(app: FastAPI, engine: AsyncLLMEngine, names: list[str], root: str,
                     lora: OpenAIServingLoRA) -> None:
    """GET /v1/models (the served names, then the loaded adapters) and /v1/models/{id}."""
    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                "root": root, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The served names, then the adapters: those the request's key may use."""
        cards = [model_card(name) for name in names] + lora.model_cards(engine.max_model_len)
        allowed = set(allowed_models([card["id"] for card in cards]))
        return {"object": "list", "data": [card for card in cards if card["id"] in allowed]}

    @app.get("/v1/models/{model_id:path}")
    @handle
    async def retrieve_model(raw_request: Request) -> Response:
        """One model card (OpenAI's `client.models.retrieve`); 404 for a model not served."""
        model_id = raw_request.path_params["model_id"]
        if not allowed_models([model_id]):
            raise APIError(f"The model `{model_id}` does not exist.", 404, param="model",
                           code="model_not_found")
        for card in lora.model_cards(engine.max_model_len):
            if card["id"] == model_id:
                return JSONResponse(card)
        if model_id not in names:
            raise APIError(f"The model `{model_id}` does not exist.", 404, param="model",
                           code="model_not_found")
        return JSONResponse(model_card(model_id))


def add_lora_routes(app: FastAPI, lora: OpenAIServingLoRA) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating)."""

    def check_may_manage() -> None:
        """Adapters serve every key: only a key with every model may change them."""
        grant = current_grant.get()
        if grant is not None and grant.key.models is not None:
            raise APIError("this API key may not load or unload adapters (it needs access to "
                           "all models: models: [\"*\"] in --api-keys-file)", 403,
                           "permission_error", code="insufficient_permissions")

    @app.post("/v1/load_lora_adapter")
    @handle
    async def load_lora_adapter(raw_request: Request) -> Response:
        """Load a PEFT adapter and serve it under lora_name (vLLM's endpoint)."""
        check_may_manage()
        request = await parse_body(raw_request, LoadLoRAAdapterRequest)
        return Response(await lora.load(request), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    @handle
    async def unload_lora_adapter(raw_request: Request) -> Response:
        """Stop serving an adapter; its running requests finish first."""
        check_may_manage()
        request = await parse_body(raw_request, UnloadLoRAAdapterRequest)
        return Response(await lora.unload(request), media_type="text/plain")


def add_tokenizer_routes(app: FastAPI, engine: AsyncLLMEngine,
                         completions: OpenAIServingCompletion, chat: OpenAIServingChat,
                         with_tokenizer_info: bool) -> None:
    """POST /tokenize and /detokenize; GET /tokenizer_info when `with_tokenizer_info`."""

    @app.post("/tokenize")
    @handle
    async def tokenize(raw_request: Request) -> Response:
        """Text (`prompt`) or chat `messages` → token ids (vLLM's /tokenize)."""
        request = await parse_body(raw_request, TokenizeRequest)
        completions.model_name(request.model)
        if request.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            tokens = await chat.render(request, messages, request.add_generation_prompt)
        else:
            tokens = await completions.encode(request.prompt,
                                              add_special_tokens=request.add_special_tokens)
        body: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_model_len,
                                "tokens": tokens}
        if request.return_token_strs:
            body["token_strs"] = await off_loop_if(len(tokens) > INLINE_TOKEN_IDS,
                                                   engine.tokenizer.convert_ids_to_tokens,
                                                   tokens)
        return JSONResponse(body)

    @app.post("/detokenize")
    @handle
    async def detokenize(raw_request: Request) -> Response:
        """Token ids → text (vLLM's /detokenize)."""
        request = await parse_body(raw_request, DetokenizeRequest)
        completions.model_name(request.model)
        tokens = request.tokens

        def run() -> str:
            completions.check_token_ids(tokens, param="tokens")
            return decode_releasing_gil(engine.tokenizer, tokens)
        return JSONResponse({"prompt": await off_loop_if(len(tokens) > INLINE_TOKEN_IDS, run)})

    if with_tokenizer_info:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> Response:
            """The tokenizer's configuration and chat template (vLLM's /tokenizer_info)."""
            return JSONResponse(tokenizer_info(engine.tokenizer, chat.chat_template))


def add_operations_routes(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics,
                          server: ServerConfig) -> None:
    """GET /health, /livez, /readyz (health.py says what each means), /version, /metrics."""

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 with the reason while it restarts after a failed
        step, while the server shuts down, once the engine is dead or stalled, and while one
        engine iteration has run longer than --step-stall-timeout (the watchdog)."""
        problem = health_problem(engine, server.step_stall_timeout)
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(error_body(f"unhealthy: {problem}", "service_unavailable"),
                            status_code=503)

    @app.get("/livez")
    async def livez() -> Response:
        """Liveness: the engine loop is advancing (a restart would not help otherwise)."""
        status, body = liveness(engine, server.liveness_stall_timeout)
        return JSONResponse(body, status_code=status)

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness: this replica can take a request and produce a token now."""
        status, body = readiness(engine, server.step_stall_timeout)
        return JSONResponse(body, status_code=status)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jaxserve.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)


# -- parsing a request body ----------------------------------------------------------------------
ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_BODY_BYTES = 32 << 20          # a request body larger than this is refused (400)
INLINE_BODY_BYTES = 256 << 10      # larger bodies are parsed and validated on a worker thread
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
    if len(body) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(_decode_body, body, model_type, True)
    return _decode_body(body, model_type)


def _decode_body(body: bytes, model_type: type[ModelT], large: bool = False) -> ModelT:
    """The validated model of a JSON body; APIError (400) for anything wrong with it.
    A large body is parsed with orjson: any JSON parser holds the GIL while it runs (stalling
    the event loop even from a worker thread), and orjson holds it 4-5x shorter. It refuses
    what the json module would also make a 400 here (lone surrogates, NaN, deep nesting) and
    integers beyond 64 bits, which no field takes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8: {exc}") from None
    try:
        data = orjson.loads(body) if large else json.loads(text)
    except RecursionError:
        raise APIError("request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:      # JSONDecodeError, or an integer of too many digits
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):      # "\ud800" decodes to a string no tokenizer takes
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(f"request body contains an unpaired UTF-16 surrogate: {exc}") \
                from None
        except RecursionError:
            raise APIError("request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise APIError("request body is nested too deeply") from None
