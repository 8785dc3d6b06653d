"""The OpenAI-compatible HTTP server: the app factory and the process that serves it.

    engine = AsyncLLMEngine(EngineCore(config.engine))
    app = build_app(engine, config)           # FastAPI; routes in routes.py
    run_server(config)                        # all of it, plus uvicorn and clean shutdown

Routes (`routes.py`): POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{id}, GET /health, GET /version, POST /tokenize, POST /detokenize,
GET /metrics, GET /tokenizer_info (with --enable-tokenizer-info-endpoint), POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (with --allow-runtime-lora-updating).
Every error is `{"error": {"message", "type", "param", "code"}}` with 400 for any invalid
request (never FastAPI's 422), 401 for a missing or wrong API key,
404 for an unknown model or a route this server does not serve (e.g. /v1/embeddings).
`--api-key` guards every route but /health and /metrics. Every response carries an
`x-request-id` header (the client's, if it sent one); CORS follows --allowed-origins etc.
(`middleware.py`); errors leave in OpenAI's shape (`error_handlers.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI

import jaxserve
from jaxserve.config import ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.error_handlers import add_error_handlers
from jaxserve.entrypoints.openai.middleware import add_middleware, api_key_from, key_table_from
from jaxserve.entrypoints.openai.rate_limit import make_rate_limiter
from jaxserve.entrypoints.openai.routes import (
    add_generation_routes,
    add_lora_routes,
    add_model_routes,
    add_operations_routes,
    add_tokenizer_routes,
)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_lora import OpenAIServingLoRA
from jaxserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxserve.metrics import attach_metrics

__all__ = ["admission_limit", "api_key_from", "build_app", "run_server", "served_model_names"]

logger = logging.getLogger(__name__)


def served_model_names(config: ServeConfig, engine: AsyncLLMEngine) -> list[str]:
    """--served-model-name, else the model as given (vLLM), else the embedded model's name."""
    names = config.engine.model_config.served_model_name
    if names:
        return list(names)
    if config.engine.model_config.model:
        return [config.engine.model_config.model]
    path = engine.model_path
    return [os.path.basename(str(path)).removesuffix(".gguf") if path else "default"]


def admission_limit(config: ServeConfig) -> int | None:
    """Unfinished sequences the server admits: every replica's running batch
    (--max-num-seqs each) plus --max-queued-requests waiting; None: no limit."""
    queued = config.server.max_queued_requests
    if queued is None or queued < 0:
        return None
    engine = config.engine
    replicas = engine.parallel_config.data_parallel_size
    return engine.scheduler_config.max_num_seqs * replicas + queued


def _apply_server_limits(engine: AsyncLLMEngine, config: ServeConfig) -> None:
    """The server's admission, queue-time and restart limits, set on the engine."""
    config.server.check()
    engine.max_unfinished_seqs = admission_limit(config)
    engine.max_queue_time = config.server.max_queue_time
    engine.max_restarts = config.server.max_engine_restarts


def build_app(engine: AsyncLLMEngine, config: ServeConfig | None = None,
              api_key: str | list[str] | None = None) -> FastAPI:
    """A FastAPI app serving `engine`. The caller starts and shuts down the engine.
    `api_key` (one or several) overrides the config's keys."""
    config = config or ServeConfig(engine=engine.config)
    server = config.server
    names = served_model_names(config, engine)
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, server)
    tracer = None
    if server.otlp_traces_endpoint:
        from jaxserve.entrypoints.openai.tracing import RequestTracer
        tracer = RequestTracer(server.otlp_traces_endpoint)
    for serving in (completions, chat):
        serving.tracer = tracer
        serving.log_requests = server.enable_log_requests
        serving.return_tokens_as_token_ids = server.return_tokens_as_token_ids
        serving.enable_prompt_tokens_details = server.enable_prompt_tokens_details
    lora = OpenAIServingLoRA(engine.lora_registry, names[0])
    lora.load_startup_modules(server.lora_modules)
    _apply_server_limits(engine, config)
    metrics = attach_metrics(engine, names[0])
    engine.engine_core.add_metrics(metrics.registry, names[0])   # e.g. per-replica series under dp

    app = FastAPI(title="jaxserve", version=jaxserve.__version__,
                  description="OpenAI-compatible LLM server on JAX/XLA")
    app.state.engine = engine
    app.state.metrics = metrics
    keys = key_table_from(config, api_key)
    app.state.keys = keys
    app.state.rate_limiter = None
    if keys is not None:
        app.state.rate_limiter = make_rate_limiter(server.rate_limit_backend,
                                                   server.rate_limit_fail_mode)
        app.router.on_shutdown.append(app.state.rate_limiter.close)
    add_middleware(app, server, keys, app.state.rate_limiter)
    app.state.tracer = tracer
    if tracer is not None:
        from jaxserve.entrypoints.openai.tracing import TraceHeadersMiddleware
        app.add_middleware(TraceHeadersMiddleware)
        app.router.on_shutdown.append(tracer.shutdown)
    add_generation_routes(app, completions, chat, OpenAIServingResponses(chat))
    add_model_routes(app, engine, names, config.engine.model_config.model or names[0], lora)
    if server.allow_runtime_lora_updating:
        add_lora_routes(app, lora)
    add_tokenizer_routes(app, engine, completions, chat,
                         server.enable_tokenizer_info_endpoint)
    add_operations_routes(app, engine, metrics, server)
    add_error_handlers(app)
    return app


# -- running it -----------------------------------------------------------------------------------
def uvicorn_options(server: Any) -> dict[str, Any]:
    """uvicorn's --root-path and TLS settings (vLLM's flags: --ssl-keyfile, --ssl-certfile,
    --ssl-ca-certs, --ssl-cert-reqs; none for plain HTTP)."""
    options: dict[str, Any] = {"root_path": server.root_path or ""}
    if not server.ssl_certfile and not server.ssl_keyfile:
        return options
    if not server.ssl_certfile or not server.ssl_keyfile:
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    for flag, path in (("--ssl-certfile", server.ssl_certfile),
                       ("--ssl-keyfile", server.ssl_keyfile),
                       ("--ssl-ca-certs", server.ssl_ca_certs)):
        if path and not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {path}: no such file")
    options.update(ssl_keyfile=server.ssl_keyfile, ssl_certfile=server.ssl_certfile,
                   ssl_cert_reqs=server.ssl_cert_reqs)
    if server.ssl_ca_certs:
        options["ssl_ca_certs"] = server.ssl_ca_certs
    return options


def run_server(config: ServeConfig) -> int:
    """Listen at once, load the engine meanwhile, serve until SIGINT/SIGTERM, shut down
    cleanly; returns the exit status: 0 after a signal, 1 when loading failed or the engine
    died (--max-engine-restarts failed steps in a row), so a supervisor restarts the process.

    While the engine loads, /readyz says which phase and how far and the API answers 503
    (serving_app.py). On SIGTERM or SIGINT: new requests get 503 and /health 503, in-flight
    requests get --shutdown-timeout s to finish, the rest are aborted (their streams end
    with finish_reason "abort"), then the process exits. A second SIGINT exits at once.
    """
    from jaxserve.entrypoints.openai.serving_app import BAD_INPUT_ERRORS, ServingApp, metrics_app
    from jaxserve.parallel.launch import create_engine_core, prepare_process

    server_config = config.server
    server_config.check()
    if server_config.metrics_port is not None and \
            server_config.metrics_port == server_config.port != 0:
        raise ValueError(f"--metrics-port {server_config.metrics_port} is the API port; "
                         "pick another")
    parallel = config.engine.parallel_config
    if parallel.num_processes > 1:
        # On this thread, before uvicorn's signal handlers: jax.distributed installs its own.
        # The server listens once every process of the group has joined.
        prepare_process(config.engine)
        if parallel.process_id != 0:
            create_engine_core(config.engine)   # a follower: serves the leader's steps, exits
            return 0

    shell = ServingApp(config)
    host = server_config.host or "0.0.0.0"
    uv_config = uvicorn.Config(
        shell, host=host, port=server_config.port,
        log_level=server_config.uvicorn_log_level,
        # After the drain every request has ended: connections close at once.
        timeout_graceful_shutdown=10.0,
        access_log=not server_config.disable_uvicorn_access_log,
        **uvicorn_options(server_config))
    server = _Server(uv_config, shell=shell, shutdown_timeout=server_config.shutdown_timeout)

    def make_engine() -> AsyncLLMEngine:
        from jaxserve.engine.fault_injection import StepFaultInjector

        core = create_engine_core(config.engine)      # tp / dp / multi-host (jaxserve/parallel)
        if server_config.fault_injection_every_steps:
            core.fault_hook = StepFaultInjector(server_config.fault_injection_every_steps)
            logger.warning("TESTING ONLY: a step fault is injected every %d steps "
                           "(--fault-injection-every-steps)",
                           server_config.fault_injection_every_steps)
        engine = AsyncLLMEngine(core)
        engine.on_fatal = server.engine_died
        return engine

    server.start_loading = lambda: threading.Thread(
        target=shell.load, args=(make_engine,), daemon=True, name="jaxserve-load").start()
    metrics_server = None
    if server_config.metrics_port is not None:
        metrics_server = uvicorn.Server(uvicorn.Config(
            metrics_app(shell), host=host, port=server_config.metrics_port,
            log_level=server_config.uvicorn_log_level, access_log=False))
        threading.Thread(target=metrics_server.run, daemon=True,
                         name="jaxserve-metrics").start()
    try:
        server.run()
    finally:
        if metrics_server is not None:
            metrics_server.should_exit = True
        if shell.engine is not None:
            logger.info("shutting down the engine")
            shell.engine.shutdown(drain_timeout=0.0)
    if not shell.loaded.is_set():
        # The loading thread is deep in JAX (compiling, reading weights): a normal
        # interpreter exit would wait on or tear down under it. Nothing is left to save.
        logger.info("exiting while the model was still loading")
        logging.shutdown()
        os._exit(server.exit_code)
    if isinstance(shell.load_error, BAD_INPUT_ERRORS):
        raise shell.load_error          # a bad model or option: the CLI's one-line error
    logger.info("bye")
    return server.exit_code


def reload_keys_on(keys: Any) -> Any:
    """A signal handler that re-reads the keys file (SIGHUP) of `keys` (a KeyTable)."""
    def handler(sig: int, frame: Any) -> None:
        logger.info("signal %d: re-reading the API keys file %s", sig, keys.keys_file)
        keys.reload()
    return handler


class _Server(uvicorn.Server):
    """uvicorn's Server, plus loading in the background once it listens, our 'serving on'
    line, a draining shutdown, and the exit status.

    The first SIGINT/SIGTERM starts a drain (a thread: the engine refuses new requests with
    503 while uvicorn keeps answering; in-flight requests get `shutdown_timeout` s, then are
    aborted); uvicorn's own shutdown starts once no request is left. A signal while the
    model loads exits at once. A second SIGINT exits at once. uvicorn re-raises a caught
    SIGTERM after its shutdown (so the process dies by the signal); a server that shut down
    cleanly exits 0 instead.
    """

    def __init__(self, config: Any, shell: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.shell = shell
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self.start_loading: Any = None       # called once the sockets listen
        self.address = ("localhost", config.port)
        self._drain: threading.Thread | None = None
        shell.on_loaded = self._loaded
        shell.on_load_failed = self._load_failed

    @property
    def engine(self) -> AsyncLLMEngine | None:
        return self.shell.engine

    def _reload_keys(self, sig: int, frame: Any) -> None:
        keys = self.keys
        if keys is None:        # still loading: the app reads the file when it is built
            logger.info("signal %d: the API keys file is read once the model is loaded", sig)
            return
        reload_keys_on(keys)(sig, frame)

    @property
    def scheme(self) -> str:
        return "https" if self.config.ssl_certfile else "http"

    @property
    def keys(self) -> Any:
        """The KeyTable SIGHUP re-reads (None until loaded: the app reads the file then)."""
        app = self.shell.app
        return app.state.keys if app is not None else None

    def handle_exit(self, sig: int, frame: Any) -> None:
        engine = self.engine
        if engine is None:
            logger.info("signal %d while the model loads: exiting", sig)
            self.should_exit = True
            return
        if self._drain is None and not self.should_exit:
            logger.info("signal %d: draining (new requests get 503; in-flight ones get %g s "
                        "to finish; Ctrl-C again to quit now)", sig, self.shutdown_timeout)
            engine.stop_accepting()
            self._drain = threading.Thread(target=self._drain_then_exit, daemon=True,
                                           name="jaxserve-drain")
            self._drain.start()
        elif sig == signal.SIGINT:
            logger.info("second SIGINT: exiting now")
            engine.abort_all()
            self.should_exit = self.force_exit = True

    def _drain_then_exit(self) -> None:
        engine = self.engine
        if not engine.wait_until_idle(self.shutdown_timeout):
            logger.info("shutdown timeout (%g s) passed: aborting the requests still running",
                        self.shutdown_timeout)
            engine.abort_all()
            engine.wait_until_idle(10.0)
        self.should_exit = True

    def engine_died(self, exc: BaseException) -> None:
        """Called on the engine thread when the engine is dead for good: exit non-zero."""
        logger.error("the engine is dead (%r): exiting with status 1 for a supervisor to "
                     "restart the server", exc)
        self.exit_code = 1
        self.should_exit = True

    def _load_failed(self, exc: BaseException) -> None:
        """Loading failed: stop serving; run_server reports it (exit 1, or the CLI's line)."""
        self.exit_code = 1
        self.should_exit = True

    def _loaded(self, engine: AsyncLLMEngine) -> None:
        if self.should_exit:            # a signal came while loading
            return
        host, port = self.address
        shown = "localhost" if host in ("0.0.0.0", "::") else host
        names = served_model_names(self.shell.config, engine)
        logger.info("serving %s on %s://%s:%d (OpenAI API at %s://%s:%d/v1; "
                    "Ctrl-C to stop)", ", ".join(names), self.scheme, host, port, self.scheme,
                    shown, port)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.config.host, self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    break
            self.address = (host, port)
            logger.info("listening on %s://%s:%d while the model loads (GET /readyz "
                        "shows the phase and progress)", self.scheme, host, port)
            if self.start_loading is not None:
                self.start_loading()

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        if self.shell.config.server.api_keys_file:
            original[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._reload_keys)
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
