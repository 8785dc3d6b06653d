"""The server side of the engine: one background thread owns `LLMEngine` and steps it.

`LLMEngine` is synchronous and not thread-safe, so exactly one thread (the
engine thread) ever calls it. The asyncio side talks to it through a
thread-safe inbox of commands (add, abort, stop) guarded by a condition
variable; the engine thread sleeps on that condition while there is no work
and steps back to back while there is. Outputs travel the other way through
`loop.call_soon_threadsafe`, one call per step, into a per-request
`asyncio.Queue`: token deltas only (`EngineCoreOutput`). The text -- detokenization, stop
strings, logprob token text -- is built on the asyncio side as the consumer reads
(`RequestText`), so the engine thread's cost per step does not grow with what requests
have produced; a stop string found there finishes its sequence in the engine (a
"finish" command), which frees its KV blocks.

    engine = AsyncLLMEngine(LLMEngine(config))    # starts the engine thread
    async for out in engine.generate(request_id, None, params, prompt_token_ids=ids):
        ...                       # RequestOutputs, as params.output_kind says
    engine.shutdown()

Requests are validated on the asyncio side before they are queued (`InputProcessor`);
`submit` queues without waiting, so a k-prompt request queues all k before the engine's
next step and waits for their acceptance once (`wait_accepted`).

Leaving the `async for` early (client disconnect, cancellation, an exception)
aborts the request, so its KV blocks return to the pool. An exception inside
the engine thread fails every in-flight request with `EngineDeadError` and
marks the engine dead (`is_healthy` turns False); it never leaves a client
waiting.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.engine.engine_io import EngineCoreOutput
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.protocol import SteppedEngine
from jaxserve.engine.request_text import RequestText, TokenTexts
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.engine.watchdog import StepWatchdog
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed or was shut down; no request can complete."""


# Observer of every step's outputs, called on the engine thread: (outputs, wall time).
OutputObserver = Callable[[list[EngineCoreOutput], float], None]


class _RequestStream:
    """Where one request's outputs go: an asyncio.Queue living on the caller's loop, and the
    request's text state, touched only there."""

    __slots__ = ("accepted", "finished", "loop", "queue", "request_id", "text")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 text: RequestText) -> None:
        self.request_id = request_id
        self.loop = loop
        self.text = text
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False


class AsyncLLMEngine:
    """Runs an `LLMEngine` on its own thread and serves many asyncio callers."""

    def __init__(self, engine: SteppedEngine, *, start: bool = True) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._streams: dict[str, _RequestStream] = {}     # touched by the engine thread only
        self._accepting = True
        self._stopping = False
        self._dead: BaseException | None = None
        self._observers: list[OutputObserver] = []
        self.snapshot: EngineSnapshot = engine.snapshot()
        self.inputs = InputProcessor(engine.tokenizer, engine.max_model_len,
                                     engine.config.model_config.max_logprobs)
        self._token_texts = TokenTexts(engine.tokenizer)
        self.last_step_time = time.monotonic()
        self.watchdog = StepWatchdog()       # how long the current iteration has run (/health)
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._publish_snapshot()
        self._thread.start()

    def add_output_observer(self, observer: OutputObserver) -> None:
        """Call `observer(outputs, now)` on the engine thread after every step (metrics)."""
        self._observers.append(observer)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def lora_registry(self) -> Any:
        """The engine's LoRARegistry; None when LoRA is off (always under data parallelism)."""
        return self.engine.lora_registry

    def shutdown(self, drain_timeout: float = 0.0, join_timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests run up to `drain_timeout` s; abort the rest.

        Returns when the engine thread has exited (or `join_timeout` passed).
        """
        with self._cond:
            self._accepting = False
            self._cond.notify()
        if drain_timeout > 0:
            deadline = time.monotonic() + drain_timeout
            with self._cond:
                while self._streams and self._dead is None and self._thread.is_alive():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", join_timeout)

    # -- the asyncio side ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int] | None, sampling_params: Any,
               *, prompt_token_ids: list[int] | None = None,
               arrival_time: float | None = None, lora_request: Any = None) -> _RequestStream:
        """Validate a request and queue it for the engine, without waiting (call from the
        event loop). ValueError for a bad request; the engine's own verdict arrives on the
        stream's `accepted` future (`wait_accepted`)."""
        request = self.inputs.process(request_id, prompt, sampling_params,
                                      prompt_token_ids=prompt_token_ids,
                                      arrival_time=arrival_time, lora_request=lora_request)
        stream = _RequestStream(request_id, asyncio.get_running_loop(),
                                RequestText(request, self.tokenizer, self._token_texts))
        self._submit(("add", stream, request))
        return stream

    async def wait_accepted(self, streams: list[_RequestStream]) -> None:
        """Wait until the engine accepted every stream's request; if it rejects one (or the
        wait is cancelled), abort them all and raise (ValueError, EngineDeadError)."""
        try:
            await asyncio.gather(*(stream.accepted for stream in streams))
        except BaseException:
            for stream in streams:
                self.abort(stream.request_id)
            raise

    async def add_request(self, request_id: str, prompt: str | list[int] | None,
                          sampling_params: Any, *, prompt_token_ids: list[int] | None = None,
                          arrival_time: float | None = None,
                          lora_request: Any = None) -> _RequestStream:
        """Submit a request; returns once the engine accepted it.

        Raises ValueError when the request is rejected (nothing changes then), and
        EngineDeadError when the engine is dead or shutting down.
        """
        stream = self.submit(request_id, prompt, sampling_params,
                             prompt_token_ids=prompt_token_ids, arrival_time=arrival_time,
                             lora_request=lora_request)
        await self.wait_accepted([stream])
        return stream

    async def stream_outputs(self, stream: _RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield a request's RequestOutputs; leaving early aborts the request.

        The engine's token deltas are turned into text here, on the consumer's side: all
        that arrived since the last output becomes one RequestOutput."""
        try:
            while not stream.finished:
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                output = self._apply(stream, items)
                if output is not None:
                    yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def _apply(self, stream: _RequestStream, items: list[Any]) -> RequestOutput | None:
        """Feed engine outputs to the request's text state; tell the engine which sequences
        a stop string finished. Raises an engine error that arrived instead."""
        text = stream.text
        to_stop: list[int] = []
        for item in items:
            if isinstance(item, BaseException):
                stream.finished = True
                raise item
            if not text.finished:
                to_stop += text.apply(item)
        if to_stop:
            self._submit(("finish", [(stream.request_id, i) for i in to_stop]), force=True)
        stream.finished = text.finished
        return text.make_output()

    async def generate(self, request_id: str, prompt: str | None, sampling_params: Any, *,
                       prompt_token_ids: list[int] | None = None,
                       arrival_time: float | None = None,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative RequestOutputs until it finishes."""
        stream = await self.add_request(request_id, prompt, sampling_params,
                                        prompt_token_ids=prompt_token_ids,
                                        arrival_time=arrival_time, lora_request=lora_request)
        async for output in self.stream_outputs(stream):
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent; unknown ids are ignored)."""
        if self._dead is None and self._thread.is_alive():
            self._submit(("abort", request_id), force=True)

    def abort_all(self) -> None:
        """Abort every in-flight request (thread-safe); each stream ends with "abort"."""
        if self._dead is None and self._thread.is_alive():
            self._submit(("abort_all",), force=True)

    def _submit(self, command: tuple, force: bool = False) -> None:
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is dead: {self._dead!r}")
            if not force and not self._accepting:
                raise EngineDeadError("the engine is shutting down")
            self._inbox.append(command)
            self._cond.notify()

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping \
                            and not engine.has_unfinished_requests():
                        self._cond.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                self.watchdog.begin()
                aborted = self._handle_commands(commands)
                if stopping:
                    self._abort_all()
                    return
                # After an abort, step even if the engine says it is idle: the aborted
                # request's final output comes out of the next step().
                if aborted or engine.has_unfinished_requests():
                    outputs = engine.step_core()
                    self.last_step_time = time.monotonic()
                    self._dispatch(outputs)
                    self._publish_snapshot()
                self.watchdog.end()
        except BaseException as exc:   # every failure must reach the clients, never hang them
            logger.exception("engine thread failed; failing all in-flight requests")
            self._fail_all(exc)
        finally:
            self.watchdog.end()
            with self._cond:
                self._cond.notify_all()

    def _handle_commands(self, commands: list[tuple]) -> bool:
        """Apply queued adds and aborts; returns whether anything was aborted."""
        engine = self.engine
        aborted = False
        for command in commands:
            if command[0] == "add":
                _, stream, request = command
                if stream.request_id in self._streams:
                    _resolve(stream, ValueError(
                        f"request id {stream.request_id!r} is already in use"))
                    continue
                try:
                    engine.add_core_request(request)
                except (ValueError, TypeError) as exc:
                    _resolve(stream, ValueError(str(exc)))
                    continue
                self._streams[stream.request_id] = stream
                _resolve(stream, None)
            elif command[0] == "finish":
                engine.finish_sequences([(request_id, index) for request_id, index in command[1]
                                         if request_id in self._streams])
            elif command[0] == "abort":
                if command[1] in self._streams:
                    engine.abort_request(command[1])
                    aborted = True
            elif command[0] == "abort_all" and self._streams:
                logger.info("aborting %d in-flight request(s)", len(self._streams))
                engine.abort_request(list(self._streams))
                aborted = True
        return aborted

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.time()
        for observer in self._observers:
            try:
                observer(outputs, now)
            except Exception:   # metrics must never stop the engine
                logger.exception("output observer failed")
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            _call_in_loop(loop, _put_all, items)
        if not self._streams:
            with self._cond:
                self._cond.notify_all()      # a draining shutdown() waits for this

    def _abort_all(self) -> None:
        """Abort every in-flight request and deliver its final output (shutdown)."""
        engine = self.engine
        if self._streams:
            logger.info("aborting %d in-flight request(s)", len(self._streams))
            engine.abort_request(list(self._streams))
            for _ in range(1000):
                self._dispatch(engine.step_core())
                if not self._streams or not engine.has_unfinished_requests():
                    break
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._publish_snapshot()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            if not isinstance(exc, EngineDeadError) or self._dead is None:
                self._dead = exc
            pending = [c[1] for c in self._inbox if c[0] == "add"]
            self._inbox.clear()
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine failed: {exc!r}")
        for stream in pending:
            _resolve(stream, error)
        for stream in self._streams.values():
            _call_in_loop(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()

    def _publish_snapshot(self) -> None:
        self.snapshot = self.engine.snapshot()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(stream: _RequestStream, error: BaseException | None) -> None:
    """Settle a stream's `accepted` future from the engine thread."""
    def settle() -> None:
        if stream.accepted.done():
            return
        if error is None:
            stream.accepted.set_result(None)
        else:
            stream.accepted.set_exception(error)
    _call_in_loop(stream.loop, settle)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:            # the caller's loop is closed: nobody is listening
        pass
