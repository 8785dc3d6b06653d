"""The server's front end: one background thread owns the engine core and steps it.

The engine core (`EngineCore`) is synchronous and not thread-safe, so exactly one thread
(the engine thread) ever calls it. The asyncio side talks to it through a
thread-safe inbox of commands (add, abort, stop) guarded by a condition
variable; the engine thread sleeps on that condition while there is no work
and steps back to back while there is. Outputs travel the other way through
`loop.call_soon_threadsafe`, one call per step, into a per-request
`asyncio.Queue`: token deltas only (`EngineCoreOutput`). The text -- detokenization, stop
strings, logprob token text -- is built on the asyncio side as the consumer reads
(`OutputProcessor.apply`, the output processing `LLMEngine` runs too), so the engine
thread's cost per step does not grow with what requests have produced; a stop string
found there finishes its sequence in the core (a "finish" command), which frees its KV
blocks.

This module is the asyncio-facing front (submit, streams, lifecycle); it composes parts
that each own their state: the engine thread's loop, inbox, recovery and output dispatch
(`EngineThread`, engine_thread.py), admission control (`Admission`, admission.py), a
request's stream (request_stream.py), and the processors shared with `LLMEngine`.

    engine = AsyncLLMEngine(EngineCore(config))   # starts the engine thread
    async for out in engine.generate(request_id, None, params, prompt_token_ids=ids):
        ...                       # RequestOutputs, as params.output_kind says
    engine.shutdown()

Requests are validated on the asyncio side before they are queued (`InputProcessor`);
`submit` queues without waiting, so a k-prompt request queues all k before the engine's
next step and waits for their acceptance once (`wait_accepted`).

Leaving the `async for` early (client disconnect, cancellation, an exception)
aborts the request, so its KV blocks return to the pool.

Faults. A request's own data failing in output processing ends that request alone
(finish_reason "error", EngineCore). A failing `step()` (a device error, a bug) fails
the requests that had been scheduled with `StepFailedError`, then the engine
recovers in-process: `EngineCore.recover()` rebuilds the scheduler, block manager
and KV cache, and requests that were still queued are added again and run from
scratch. After `max_restarts` consecutive failed steps (no good step between) the
engine is dead: every request fails with `EngineDeadError`, `is_healthy` stays
False and `on_fatal` is called (the server then exits non-zero for a supervisor to
restart it). No client is ever left waiting.

Admission. `reserve(n)` admits n sequences while fewer than `max_unfinished_seqs`
are unfinished (else `QueueFullError`); each stream gives its sequences back when
it ends. With `max_queue_time` set, a request still unscheduled after that many
seconds ends with `QueueTimeoutError`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.engine.admission import Admission
from jaxserve.engine.engine_thread import EngineThread, OutputObserver
from jaxserve.engine.errors import EngineDeadError, ShuttingDownError
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.protocol import EngineCoreInterface
from jaxserve.engine.request_stream import RequestStream
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.engine.watchdog import StepWatchdog
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "OutputObserver"]


class AsyncLLMEngine:
    """Runs an engine core on its own thread and serves many asyncio callers."""

    def __init__(self, engine_core: EngineCoreInterface | LLMEngine, *,
                 start: bool = True) -> None:
        """engine_core: the core to serve; an `LLMEngine` (`LLM(...).llm_engine`) is served
        through its core, which then belongs to this engine (do not step it elsewhere)."""
        if isinstance(engine_core, LLMEngine):
            engine_core = engine_core.engine_core
        self.engine_core = engine_core
        self.input_processor = InputProcessor.for_core(engine_core)
        self.output_processor = OutputProcessor(engine_core.tokenizer)
        self.admission = Admission()
        self.engine_thread = EngineThread(engine_core, self.admission)
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.engine_thread.start()

    def add_output_observer(self, observer: OutputObserver) -> None:
        """Call `observer(outputs, now)` on the engine thread after every step (metrics)."""
        self.engine_thread.add_output_observer(observer)

    def add_failure_observer(self, observer: Callable[[list[str]], None]) -> None:
        """Call `observer(request_ids)` on the engine thread for requests that end with an
        error instead of a final output (a failed step, a queue timeout)."""
        self.engine_thread.add_failure_observer(observer)

    @property
    def is_healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """None while serving normally; else why not (recovering, shutting down, dead)."""
        thread = self.engine_thread
        if thread.dead_error is not None:
            return f"engine dead: {thread.dead_error!r}"
        if not thread.alive or thread.stopping:
            return "engine stopped"
        if not thread.accepting:
            return "shutting down"
        return thread.recovering

    @property
    def dead_error(self) -> BaseException | None:
        return self.engine_thread.dead_error

    @property
    def loop_running(self) -> bool:
        """The engine thread is alive and the engine not dead (it may be idle or draining)."""
        return self.engine_thread.dead_error is None and self.engine_thread.alive

    @property
    def accepting(self) -> bool:
        """New requests are taken (False once a drain or shutdown began)."""
        return self.engine_thread.accepting

    @property
    def recovery_reason(self) -> str | None:
        """Why the engine is restarting in-process after a failed step; None otherwise."""
        return self.engine_thread.recovering

    @property
    def snapshot(self) -> EngineSnapshot:
        """The core's gauges and counters as of the engine thread's last step."""
        return self.engine_thread.snapshot

    @property
    def watchdog(self) -> StepWatchdog:
        return self.engine_thread.watchdog

    @property
    def last_step_time(self) -> float:
        return self.engine_thread.last_step_time

    @property
    def num_restarts(self) -> int:
        return self.engine_thread.num_restarts

    # Fault recovery and admission limits (module docstring), set by the server from its flags.
    @property
    def max_restarts(self) -> int:
        return self.engine_thread.max_restarts

    @max_restarts.setter
    def max_restarts(self, value: int) -> None:
        self.engine_thread.max_restarts = value

    @property
    def on_fatal(self) -> Callable[[BaseException], None] | None:
        return self.engine_thread.on_fatal

    @on_fatal.setter
    def on_fatal(self, callback: Callable[[BaseException], None] | None) -> None:
        self.engine_thread.on_fatal = callback

    @property
    def max_queue_time(self) -> float | None:
        return self.engine_thread.max_queue_time

    @max_queue_time.setter
    def max_queue_time(self, seconds: float | None) -> None:
        self.engine_thread.max_queue_time = seconds

    @property
    def max_unfinished_seqs(self) -> int | None:
        return self.admission.max_unfinished_seqs

    @max_unfinished_seqs.setter
    def max_unfinished_seqs(self, cap: int | None) -> None:
        self.admission.max_unfinished_seqs = cap

    @property
    def num_rejected(self) -> Any:
        """Requests refused, by error code (a Counter)."""
        return self.admission.num_rejected

    @property
    def num_unfinished_seqs(self) -> int:
        return self.admission.num_unfinished_seqs

    def has_room(self, num_seqs: int = 1) -> bool:
        """Admission control would admit `num_seqs` more sequences now."""
        return self.admission.has_room(num_seqs)

    def reserve(self, num_seqs: int) -> None:
        """Admit `num_seqs` sequences, or raise QueueFullError (counted) at the cap."""
        self.admission.reserve(num_seqs)

    def release(self, num_seqs: int) -> None:
        """Give back admitted sequences (thread-safe)."""
        self.admission.release(num_seqs)

    def admission_error(self) -> BaseException | None:
        """Why a new request would be refused now (dead, shutting down), or None. A
        restart under way refuses nothing: new requests wait in the inbox."""
        thread = self.engine_thread
        dead = thread.dead_error
        if dead is not None or not thread.alive or thread.stopping:
            return EngineDeadError(f"the engine is not running: {dead!r}"
                                   if dead else "the engine is not running")
        if not thread.accepting:
            return ShuttingDownError("the server is shutting down")
        return None

    def stop_accepting(self) -> None:
        """Refuse new requests (ShuttingDownError); in-flight ones go on."""
        self.engine_thread.stop_accepting()

    def wait_until_idle(self, timeout: float) -> bool:
        """Block until no request is in flight (True) or `timeout` s passed (False)."""
        return self.engine_thread.wait_until_idle(timeout)

    @property
    def tokenizer(self) -> Any:
        return self.engine_core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    @property
    def config(self) -> Any:
        return self.engine_core.config

    @property
    def model_path(self) -> str:
        return self.engine_core.model_path

    @property
    def lora_registry(self) -> Any:
        """The core's LoRARegistry; None when LoRA is off (always under data parallelism)."""
        return self.engine_core.lora_registry

    def shutdown(self, drain_timeout: float = 0.0, join_timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests run up to `drain_timeout` s; abort the rest.

        Returns when the engine thread has exited (or `join_timeout` passed).
        """
        self.stop_accepting()
        if drain_timeout > 0:
            self.wait_until_idle(drain_timeout)
        self.engine_thread.stop(join_timeout)

    # -- the asyncio side ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int] | None, sampling_params: Any,
               *, prompt_token_ids: list[int] | None = None,
               arrival_time: float | None = None, lora_request: Any = None,
               reserved_seqs: int = 0) -> RequestStream:
        """Validate a request and queue it for the engine, without waiting (call from the
        event loop). ValueError for a bad request; the engine's own verdict arrives on the
        stream's `accepted` future (`wait_accepted`).

        reserved_seqs: sequences this request holds from `reserve`; from this call on the
        stream owns them: given back when it ends, is refused, or (here) fails to queue."""
        try:
            request = self.input_processor.process(
                request_id, prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                arrival_time=arrival_time, lora_request=lora_request)
            stream = RequestStream(request_id, asyncio.get_running_loop(),
                                   self.output_processor.new_request_text(request),
                                   request, reserved_seqs)
            self.engine_thread.send(("add", stream, request))
        except BaseException:
            self.release(reserved_seqs)
            raise
        return stream

    async def wait_accepted(self, streams: list[RequestStream]) -> None:
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
                          lora_request: Any = None, reserved_seqs: int = 0
                          ) -> RequestStream:
        """Submit a request; returns once the engine accepted it.

        reserved_seqs: sequences this request holds from `reserve`; given back when it
        ends (or now, if it is refused).
        Raises ValueError when the request is rejected (nothing changes then), and
        EngineDeadError when the engine is dead or shutting down.
        """
        stream = self.submit(request_id, prompt, sampling_params,
                             prompt_token_ids=prompt_token_ids, arrival_time=arrival_time,
                             lora_request=lora_request, reserved_seqs=reserved_seqs)
        await self.wait_accepted([stream])
        return stream

    async def stream_outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
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

    def _apply(self, stream: RequestStream, items: list[Any]) -> RequestOutput | None:
        """Feed core outputs to the request's text state (`OutputProcessor.apply`); tell the
        core which sequences a stop string finished. Raises an engine error that arrived
        instead."""
        for item in items:
            if isinstance(item, BaseException):
                stream.finished = True
                raise item
        output, to_stop = self.output_processor.apply(stream.text, items)
        if to_stop:
            self.engine_thread.send(("finish", [(stream.request_id, i) for i in to_stop]),
                                   force=True)
        stream.finished = stream.text.finished
        return output

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
        if self.loop_running:
            self.engine_thread.send(("abort", request_id), force=True)

    def abort_all(self) -> None:
        """Abort every in-flight request (thread-safe); each stream ends with "abort"."""
        if self.loop_running:
            self.engine_thread.send(("abort_all",), force=True)
