"""The app uvicorn serves from its first second, before the engine exists.

Loading a model (download, weights, compiling the step buckets) takes from seconds to many
minutes. The server listens through all of it, so an orchestrator's probes and a person
see why it is not ready instead of a refused connection:

    shell = ServingApp(config)                     # a loading app answers at once
    threading.Thread(target=shell.load, args=(make_engine,)).start()
    uvicorn serves `shell`                         # the full app once load() built it

While loading: GET /livez 200 (503 if loading failed), GET /readyz 503
`{"status": "loading", "phase": "compile", "progress": 0.43}`, GET /health 503, GET
/metrics an empty exposition, GET /version; every other route 503 in OpenAI's error shape
with `Retry-After`, so a client or a load balancer retries elsewhere.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.config import ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.health import loading_liveness, loading_readiness
from jaxserve.entrypoints.openai.protocol import error_body
from jaxserve.load_progress import LOAD_PROGRESS
from jaxserve.metrics import CONTENT_TYPE

__all__ = ["ServingApp", "metrics_app"]

logger = logging.getLogger(__name__)

# What a bad model name, path or option raises: `jaxserve serve` reports it as one line.
BAD_INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
# Seconds a client is told to wait before retrying while the model loads.
LOADING_RETRY_AFTER_S = 5


class ServingApp:
    """An ASGI app: the loading app until `load` has built the engine, then the full one."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.app: Any = None                    # the full FastAPI app once loaded
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()         # set when load() ended, either way
        self.on_loaded: Callable[[AsyncLLMEngine], None] | None = None
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self._loading_app = _loading_app(self)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        app = self.app
        if app is None or scope["type"] == "lifespan":   # the full app needs no lifespan
            app = self._loading_app
        await app(scope, receive, send)

    def load(self, make_engine: Callable[[], AsyncLLMEngine]) -> None:
        """Build the engine and the full app; run on a thread while uvicorn serves."""
        try:
            engine = make_engine()
            try:
                app = build_app(engine, self.config)
            except BaseException:
                engine.shutdown()
                raise
        except BaseException as exc:
            if isinstance(exc, BAD_INPUT_ERRORS):      # the CLI prints it as one line
                logger.debug("loading the model failed", exc_info=exc)
            else:
                logger.exception("loading the model failed")
            self.load_error = exc
            self.loaded.set()
            if self.on_load_failed is not None:
                self.on_load_failed(exc)
            return
        self.engine = engine
        self.app = app
        self.loaded.set()
        if self.on_loaded is not None:
            self.on_loaded(engine)

    def render_metrics(self) -> bytes:
        """The Prometheus exposition; empty while loading (the series appear once loaded)."""
        app = self.app
        return app.state.metrics.render() if app is not None else b""


def _loading_app(shell: ServingApp) -> Starlette:
    """What answers while the model loads (the module docstring)."""

    async def livez(request: Request) -> Response:
        status, body = loading_liveness(shell.load_error)
        return JSONResponse(body, status_code=status)

    async def readyz(request: Request) -> Response:
        if shell.load_error is not None:
            return JSONResponse({"status": "failed", "reason": repr(shell.load_error)},
                                status_code=503)
        status, body = loading_readiness(LOAD_PROGRESS.state())
        return JSONResponse(body, status_code=status)

    async def metrics(request: Request) -> Response:
        return Response(shell.render_metrics(), media_type=CONTENT_TYPE)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": jaxserve.__version__})

    async def unavailable(request: Request) -> Response:
        """/health and every API route: 503 in OpenAI's shape until the model is loaded."""
        if shell.load_error is not None:
            message = f"loading the model failed: {shell.load_error!r}"
        else:
            state = LOAD_PROGRESS.state()
            done = "" if state.progress is None else f", {state.progress:.0%}"
            message = f"the model is loading ({state.phase}{done}): retry later"
        return JSONResponse(error_body(message, "service_unavailable", code="loading"),
                            status_code=503,
                            headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[
        Route("/livez", livez), Route("/readyz", readyz), Route("/metrics", metrics),
        Route("/version", version), Route("/{path:path}", unavailable, methods=methods)])


def metrics_app(shell: ServingApp) -> Starlette:
    """GET /metrics alone, for --metrics-port."""

    async def metrics(request: Request) -> Response:
        return Response(shell.render_metrics(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics)])
