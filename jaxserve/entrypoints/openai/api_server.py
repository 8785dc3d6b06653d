"""The OpenAI-compatible HTTP server: app factory, routes, error handlers, auth, `serve`.

    engine = AsyncLLMEngine(LLMEngine(config.engine))
    app = build_app(engine, config)           # FastAPI; routes below
    run_server(config)                        # all of it, plus uvicorn and clean shutdown

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{id}, GET /health, GET /version, POST /tokenize, POST /detokenize,
GET /metrics, GET /tokenizer_info (with --enable-tokenizer-info-endpoint), POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (with --allow-runtime-lora-updating).
Every error is `{"error": {"message", "type", "param", "code"}}` with 400 for any invalid
request (never FastAPI's 422), 401 for a missing or wrong API key,
404 for an unknown model or a route this server does not serve (e.g. /v1/embeddings).
`--api-key` guards every route but /health and /metrics. Every response carries an
`x-request-id` header (the client's, if it sent one); CORS follows --allowed-origins etc.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import jaxserve
from jaxserve.config import ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.errors import EngineUnavailableError
from jaxserve.entrypoints.openai.errors import (
    APIError,
    ClientGone,
    engine_error,
    validation_error,
)
from jaxserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from jaxserve.entrypoints.openai.request_body import parse_body
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.responses_protocol import ResponsesRequest
from jaxserve.entrypoints.openai.request_streams import new_request_id
from jaxserve.entrypoints.openai.serving_engine import INLINE_TOKEN_IDS, off_loop_if
from jaxserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxserve.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest,
    OpenAIServingLoRA,
    UnloadLoRAAdapterRequest,
)
from jaxserve.entrypoints.openai.tokenizer_info import tokenizer_info
from jaxserve.loader.tokenizer import decode_releasing_gil
from jaxserve.metrics import CONTENT_TYPE, attach_metrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
# A request that the engine hasn't stepped for this long while it has work is "stuck".
_HEALTH_STALL_SECONDS = 600.0


def served_model_names(config: ServeConfig, engine: AsyncLLMEngine) -> list[str]:
    """--served-model-name, else the model as given (vLLM), else the embedded model's name."""
    names = config.engine.model_config.served_model_name
    if names:
        return list(names)
    if config.engine.model_config.model:
        return [config.engine.model_config.model]
    path = engine.model_path
    return [os.path.basename(str(path)).removesuffix(".gguf") if path else "default"]


def api_key_from(config: ServeConfig) -> str | None:
    return config.server.api_key or os.environ.get("JAXSERVE_API_KEY") or None


class APIKeyMiddleware:
    """Pure ASGI middleware: `Authorization: Bearer KEY` on every path but OPEN_PATHS.

    It runs before the body is read, so a request without the key gets 401 whatever
    else is wrong with it.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS \
                or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(given, self.expected):
            response = JSONResponse(
                error_body("Incorrect API key provided." if given else
                           "Missing API key: send 'Authorization: Bearer YOUR_KEY'.",
                           "authentication_error", code="invalid_api_key"), status_code=401)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Pure ASGI middleware: every response carries `x-request-id`, the client's if it sent
    one (so a proxy's or client's id can be traced through our logs), else a fresh one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


def admission_limit(config: ServeConfig) -> int | None:
    """Unfinished sequences the server admits: every replica's running batch
    (--max-num-seqs each) plus --max-queued-requests waiting; None: no limit."""
    queued = config.server.max_queued_requests
    if queued is None or queued < 0:
        return None
    engine = config.engine
    replicas = engine.parallel_config.data_parallel_size
    return engine.scheduler_config.max_num_seqs * replicas + queued


def _cors_list(values: list[str]) -> list[str]:
    """vLLM takes these flags as one JSON list ('["https://a"]'); we also take plain words."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        parsed = json.loads(values[0])
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"expected a JSON list of strings, got {values[0]!r}")
        return parsed
    return list(values)


def build_app(engine: AsyncLLMEngine, config: ServeConfig | None = None,
              api_key: str | None = None) -> FastAPI:
    """A FastAPI app serving `engine`. The caller starts and shuts down the engine."""
    config = config or ServeConfig(engine=engine.config)
    names = served_model_names(config, engine)
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, config.server)
    responses = OpenAIServingResponses(chat)
    for serving in (completions, chat):
        serving.log_requests = not config.server.disable_log_requests
    lora = OpenAIServingLoRA(engine.lora_registry, names[0])
    lora.load_startup_modules(config.server.lora_modules)
    config.server.check()
    engine.max_unfinished_seqs = admission_limit(config)
    engine.max_queue_time = config.server.max_queue_time
    engine.max_restarts = config.server.max_engine_restarts
    metrics = attach_metrics(engine, names[0])
    engine.engine.add_metrics(metrics.registry, names[0])   # e.g. per-replica series under dp
    created = int(time.time())

    app = FastAPI(title="jaxserve", version=jaxserve.__version__,
                  description="OpenAI-compatible LLM server on JAX/XLA")
    app.state.engine = engine
    app.state.metrics = metrics
    key = api_key if api_key is not None else api_key_from(config)
    if key:
        app.add_middleware(APIKeyMiddleware, api_key=key)
    server = config.server
    # Added last = outermost: preflight and error responses get CORS headers and an id too.
    app.add_middleware(CORSMiddleware, allow_origins=_cors_list(server.allowed_origins),
                       allow_methods=_cors_list(server.allowed_methods),
                       allow_headers=_cors_list(server.allowed_headers),
                       allow_credentials=server.allow_credentials)
    app.add_middleware(RequestIdMiddleware)

    def handle(fn: Callable[[Request], Awaitable[Response]]) -> Callable:
        async def endpoint(raw_request: Request) -> Response:
            try:
                return await fn(raw_request)
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
            except EngineUnavailableError as exc:     # e.g. a failed step: 503, not 500
                error = engine_error(exc)
                return JSONResponse(error.body(), status_code=error.status,
                                    headers=error.headers)
            except ClientGone:
                return Response(status_code=499)
        endpoint.__name__ = fn.__name__
        endpoint.__doc__ = fn.__doc__
        return endpoint

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

    root = config.engine.model_config.model or names[0]
    step_stall_timeout = config.server.step_stall_timeout

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                "root": root, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in names]
                + lora.model_cards(engine.max_model_len)}

    @app.get("/v1/models/{model_id:path}")
    @handle
    async def retrieve_model(raw_request: Request) -> Response:
        """One model card (OpenAI's `client.models.retrieve`); 404 for a model not served."""
        model_id = raw_request.path_params["model_id"]
        for card in lora.model_cards(engine.max_model_len):
            if card["id"] == model_id:
                return JSONResponse(card)
        if model_id not in names:
            raise APIError(f"The model `{model_id}` does not exist.", 404, param="model",
                           code="model_not_found")
        return JSONResponse(model_card(model_id))

    if config.server.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        @handle
        async def load_lora_adapter(raw_request: Request) -> Response:
            """Load a PEFT adapter and serve it under lora_name (vLLM's endpoint)."""
            request = await parse_body(raw_request, LoadLoRAAdapterRequest)
            return Response(await lora.load(request), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        @handle
        async def unload_lora_adapter(raw_request: Request) -> Response:
            """Stop serving an adapter; its running requests finish first."""
            request = await parse_body(raw_request, UnloadLoRAAdapterRequest)
            return Response(await lora.unload(request), media_type="text/plain")

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 with the reason while it restarts after a failed
        step, while the server shuts down, once the engine is dead or stalled, and while one
        engine iteration has run longer than --step-stall-timeout (the watchdog)."""
        problem = engine.health_problem
        if problem is None and engine.snapshot.num_running > 0 and \
                time.monotonic() - engine.last_step_time > _HEALTH_STALL_SECONDS:
            problem = "engine stalled"
        busy_for = engine.watchdog.busy_for()
        if problem is None and busy_for > step_stall_timeout:
            problem = (f"the engine step has been running for {busy_for:.1f} s "
                       f"(--step-stall-timeout {step_stall_timeout:g} s)")
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(error_body(f"unhealthy: {problem}", "service_unavailable"),
                            status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": jaxserve.__version__}

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

    if config.server.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> Response:
            """The tokenizer's configuration and chat template (vLLM's /tokenizer_info)."""
            return JSONResponse(tokenizer_info(engine.tokenizer, chat.chat_template))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # Anything FastAPI or Starlette raises on its own still leaves in OpenAI's shape.
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        message = str(exc.detail)
        if status == 404 and message == "Not Found":
            message = (f"The route {request.method} {request.url.path} is not supported by "
                       f"this server (jaxserve serves /v1/completions, /v1/chat/completions, "
                       f"/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics, "
                       f"/version).")
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind, code=status), status_code=status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc!r}", "internal_server_error"),
                            status_code=500)

    return app


# -- running it -----------------------------------------------------------------------------------
def run_server(config: ServeConfig) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, shut down cleanly; returns the exit status:
    0 after a signal, 1 when the engine died (--max-engine-restarts failed steps in a row),
    so a supervisor restarts the process.

    On SIGTERM or SIGINT: new requests get 503 and /health 503, in-flight requests get
    --shutdown-timeout s to finish, the rest are aborted (their streams end with
    finish_reason "abort"), then the process exits. A second SIGINT exits at once.
    """
    from jaxserve.engine.fault_injection import StepFaultInjector
    from jaxserve.parallel.launch import create_engine

    # tp / dp / multi-host (jaxserve/parallel); on a multi-host follower this never returns.
    server_config = config.server
    core = create_engine(config.engine)
    if server_config.fault_injection_every_steps:
        core.fault_hook = StepFaultInjector(server_config.fault_injection_every_steps)
        logger.warning("TESTING ONLY: a step fault is injected every %d steps "
                       "(--fault-injection-every-steps)",
                       server_config.fault_injection_every_steps)
    engine = AsyncLLMEngine(core)
    try:
        app = build_app(engine, config)
        uv_config = uvicorn.Config(
            app, host=server_config.host or "0.0.0.0", port=server_config.port,
            log_level=server_config.uvicorn_log_level,
            # After the drain every request has ended: connections close at once.
            timeout_graceful_shutdown=10.0,
            access_log=not server_config.disable_uvicorn_access_log)
        server = _Server(uv_config, names=served_model_names(config, engine), engine=engine,
                         shutdown_timeout=server_config.shutdown_timeout)
        engine.on_fatal = server.engine_died
        server.run()
    finally:
        logger.info("shutting down the engine")
        engine.shutdown(drain_timeout=0.0)
    logger.info("bye")
    return server.exit_code


class _Server(uvicorn.Server):
    """uvicorn's Server, plus our 'serving on' line, a draining shutdown, and the exit status.

    The first SIGINT/SIGTERM starts a drain (a thread: the engine refuses new requests with
    503 while uvicorn keeps answering; in-flight requests get `shutdown_timeout` s, then are
    aborted); uvicorn's own shutdown starts once no request is left. A second SIGINT exits
    at once. uvicorn re-raises a caught SIGTERM after its shutdown (so the process dies by the
    signal); a server that shut down cleanly exits 0 instead.
    """

    def __init__(self, config: Any, names: list[str], engine: AsyncLLMEngine,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.names = names
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain is None and not self.should_exit:
            logger.info("signal %d: draining (new requests get 503; in-flight ones get %g s "
                        "to finish; Ctrl-C again to quit now)", sig, self.shutdown_timeout)
            self.engine.stop_accepting()
            self._drain = threading.Thread(target=self._drain_then_exit, daemon=True,
                                           name="jaxserve-drain")
            self._drain.start()
        elif sig == signal.SIGINT:
            logger.info("second SIGINT: exiting now")
            self.engine.abort_all()
            self.should_exit = self.force_exit = True

    def _drain_then_exit(self) -> None:
        if not self.engine.wait_until_idle(self.shutdown_timeout):
            logger.info("shutdown timeout (%g s) passed: aborting the requests still running",
                        self.shutdown_timeout)
            self.engine.abort_all()
            self.engine.wait_until_idle(10.0)
        self.should_exit = True

    def engine_died(self, exc: BaseException) -> None:
        """Called on the engine thread when the engine is dead for good: exit non-zero."""
        logger.error("the engine is dead (%r): exiting with status 1 for a supervisor to "
                     "restart the server", exc)
        self.exit_code = 1
        self.should_exit = True

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.config.host, self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    break
            shown = "localhost" if host in ("0.0.0.0", "::") else host
            logger.info("serving %s on http://%s:%d (OpenAI API at http://%s:%d/v1; "
                        "Ctrl-C to stop)", ", ".join(self.names), host, port, shown, port)

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
