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
aborts the request, so its KV blocks return to the pool.

Faults. A request's own data failing in output processing ends that request alone
(finish_reason "error", LLMEngine). A failing `step()` (a device error, a bug) fails
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
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.engine.engine_io import EngineCoreOutput
from jaxserve.engine.errors import (
    EngineDeadError,
    QueueFullError,
    QueueTimeoutError,
    ShuttingDownError,
    StepFailedError,
)
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.protocol import SteppedEngine
from jaxserve.engine.request_text import RequestText, TokenTexts
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.engine.watchdog import StepWatchdog
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "OutputObserver"]

# How often the engine thread looks for requests past --max-queue-time (seconds).
_QUEUE_TIME_CHECK_INTERVAL = 0.1


# Observer of every step's outputs, called on the engine thread: (outputs, wall time).
OutputObserver = Callable[[list[EngineCoreOutput], float], None]


class _RequestStream:
    """Where one request's outputs go: an asyncio.Queue living on the caller's loop, and the
    request's text state, touched only there."""

    __slots__ = ("accepted", "finished", "loop", "num_seqs", "queue", "request", "request_id",
                 "text")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 text: RequestText, request: Any = None, num_seqs: int = 0) -> None:
        self.request_id = request_id
        self.loop = loop
        self.text = text
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False
        self.num_seqs = num_seqs          # admitted sequences, given back when it ends
        self.request = request            # its EngineRequest: recovery re-adds queued ones


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
        self._failure_observers: list[Callable[[list[str]], None]] = []
        self.snapshot: EngineSnapshot = engine.snapshot()
        self.inputs = InputProcessor(engine.tokenizer, engine.max_model_len,
                                     engine.config.model_config.max_logprobs)
        self._token_texts = TokenTexts(engine.tokenizer)
        self.last_step_time = time.monotonic()
        self.watchdog = StepWatchdog()       # how long the current iteration has run (/health)
        # Fault recovery (module docstring): restarts allowed in a row, and who to tell
        # when the engine is dead for good (the server exits non-zero).
        self.max_restarts = 3
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.num_restarts = 0                 # in-process restarts since start
        self._consecutive_failures = 0
        self._recovering: str | None = None   # why, while a restart is under way
        # Admission control: unfinished sequences admitted (guarded by _cond), their cap
        # (None: no cap), and seconds a request may stay unscheduled (None: forever).
        self.max_unfinished_seqs: int | None = None
        self.max_queue_time: float | None = None
        self._num_seqs = 0
        self._next_queue_check = 0.0
        self.num_rejected: collections.Counter[str] = collections.Counter()  # by reason
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

    def add_failure_observer(self, observer: Callable[[list[str]], None]) -> None:
        """Call `observer(request_ids)` on the engine thread for requests that end with an
        error instead of a final output (a failed step, a queue timeout)."""
        self._failure_observers.append(observer)

    @property
    def is_healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """None while serving normally; else why not (recovering, shutting down, dead)."""
        if self._dead is not None:
            return f"engine dead: {self._dead!r}"
        if not self._thread.is_alive() or self._stopping:
            return "engine stopped"
        if not self._accepting:
            return "shutting down"
        return self._recovering

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def admission_error(self) -> BaseException | None:
        """Why a new request would be refused now (dead, shutting down), or None. A
        restart under way refuses nothing: new requests wait in the inbox."""
        if self._dead is not None or not self._thread.is_alive() or self._stopping:
            return EngineDeadError(f"the engine is not running: {self._dead!r}"
                                   if self._dead else "the engine is not running")
        if not self._accepting:
            return ShuttingDownError("the server is shutting down")
        return None

    @property
    def num_unfinished_seqs(self) -> int:
        return self._num_seqs

    def reserve(self, num_seqs: int) -> None:
        """Admit `num_seqs` sequences, or raise QueueFullError (counted) at the cap."""
        with self._cond:
            cap = self.max_unfinished_seqs
            if cap is not None and self._num_seqs + num_seqs > cap:
                self.num_rejected[QueueFullError.code] += 1
                raise QueueFullError(
                    f"the server is at capacity ({self._num_seqs} sequences in flight or "
                    f"queued; the limit is {cap}): retry later")
            self._num_seqs += num_seqs

    def release(self, num_seqs: int) -> None:
        """Give back admitted sequences (thread-safe)."""
        if num_seqs:
            with self._cond:
                self._num_seqs -= num_seqs

    def stop_accepting(self) -> None:
        """Refuse new requests (ShuttingDownError); in-flight ones go on."""
        with self._cond:
            self._accepting = False
            self._cond.notify()

    def wait_until_idle(self, timeout: float) -> bool:
        """Block until no request is in flight (True) or `timeout` s passed (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._streams and self._dead is None and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

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
        self.stop_accepting()
        if drain_timeout > 0:
            self.wait_until_idle(drain_timeout)
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
               arrival_time: float | None = None, lora_request: Any = None,
               reserved_seqs: int = 0) -> _RequestStream:
        """Validate a request and queue it for the engine, without waiting (call from the
        event loop). ValueError for a bad request; the engine's own verdict arrives on the
        stream's `accepted` future (`wait_accepted`).

        reserved_seqs: sequences this request holds from `reserve`; from this call on the
        stream owns them: given back when it ends, is refused, or (here) fails to queue."""
        try:
            request = self.inputs.process(request_id, prompt, sampling_params,
                                          prompt_token_ids=prompt_token_ids,
                                          arrival_time=arrival_time, lora_request=lora_request)
            stream = _RequestStream(request_id, asyncio.get_running_loop(),
                                    RequestText(request, self.tokenizer, self._token_texts),
                                    request, reserved_seqs)
            self._submit(("add", stream, request))
        except BaseException:
            self.release(reserved_seqs)
            raise
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
                          lora_request: Any = None, reserved_seqs: int = 0
                          ) -> _RequestStream:
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
                raise ShuttingDownError("the server is shutting down")
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
                if self.max_queue_time is not None:
                    aborted |= self._expire_queued()
                # After an abort, step even if the engine says it is idle: the aborted
                # request's final output comes out of the next step().
                if aborted or engine.has_unfinished_requests():
                    try:
                        outputs = engine.step_core()
                    except Exception as exc:
                        self._recover(exc)      # raises once the restarts are used up
                        self.watchdog.end()
                        continue
                    self._consecutive_failures = 0
                    self.last_step_time = time.monotonic()
                    self._dispatch(outputs)
                    self._publish_snapshot()
                self.watchdog.end()
        except BaseException as exc:   # every failure must reach the clients, never hang them
            logger.exception("engine thread failed; failing all in-flight requests")
            self._fail_all(exc)
            if self.on_fatal is not None:
                try:
                    self.on_fatal(exc)
                except Exception:
                    logger.exception("on_fatal callback failed")
        finally:
            self.watchdog.end()
            with self._cond:
                self._cond.notify_all()

    def _recover(self, exc: Exception) -> None:
        """A step failed: fail the requests it had scheduled, rebuild the engine, re-add
        the requests that were still queued. Raises EngineDeadError when this failure is
        one too many in a row (the caller then fails everything)."""
        self._consecutive_failures += 1
        if self._consecutive_failures > self.max_restarts:
            logger.error("engine step failed %d times in a row (--max-engine-restarts %d); "
                         "giving up", self._consecutive_failures, self.max_restarts,
                         exc_info=exc)
            raise EngineDeadError(
                f"the engine step failed {self._consecutive_failures} times in a row; "
                f"last error: {exc!r}") from exc
        logger.error("engine step failed; restarting the engine in-process", exc_info=exc)
        start = time.monotonic()
        self._recovering = f"recovering from a failed engine step: {exc!r}"
        engine = self.engine
        queued = engine.unscheduled_requests()
        kept = [s for rid, s in self._streams.items() if rid in queued]
        failed = [s for rid, s in self._streams.items() if rid not in queued]
        self._streams = {}
        self._fail_streams(failed, StepFailedError(
            f"the request was in an engine step that failed ({exc!r}); the engine restarted: "
            "retry the request"))
        engine.recover()
        self.num_restarts += 1
        for stream in kept:
            try:
                engine.add_core_request(stream.request)
            except Exception as add_exc:
                self._fail_streams([stream], StepFailedError(
                    f"could not re-queue the request after an engine restart: {add_exc!r}"))
                continue
            self._streams[stream.request_id] = stream
        self._publish_snapshot()
        self._recovering = None
        logger.warning("engine restarted in-process in %.2f s (restart %d; %d request(s) "
                       "failed, %d re-queued)", time.monotonic() - start, self.num_restarts,
                       len(failed), len(self._streams))

    def _expire_queued(self) -> bool:
        """End requests unscheduled for longer than max_queue_time (QueueTimeoutError);
        returns whether any was aborted. Checked every _QUEUE_TIME_CHECK_INTERVAL s."""
        now = time.monotonic()
        if now < self._next_queue_check:
            return False
        self._next_queue_check = now + _QUEUE_TIME_CHECK_INTERVAL
        cutoff = time.time() - self.max_queue_time
        expired = [rid for rid, arrival in self.engine.unscheduled_requests().items()
                   if arrival < cutoff and rid in self._streams]
        if not expired:
            return False
        self.engine.abort_request(expired)
        self.num_rejected[QueueTimeoutError.code] += len(expired)
        self._fail_streams([self._streams.pop(rid) for rid in expired], QueueTimeoutError(
            f"the request waited more than {self.max_queue_time:g} s (--max-queue-time) "
            "without being scheduled: retry later"))
        return True

    def _fail_streams(self, streams: list[_RequestStream], error: BaseException) -> None:
        """End streams (already out of _streams) with `error`; give back their sequences."""
        if not streams:
            return
        self.release(sum(stream.num_seqs for stream in streams))   # before the clients know
        for stream in streams:
            _call_in_loop(stream.loop, stream.queue.put_nowait, error)
        ids = [stream.request_id for stream in streams]
        for observer in self._failure_observers:
            try:
                observer(ids)
            except Exception:   # metrics must never stop the engine
                logger.exception("failure observer failed")

    def _handle_commands(self, commands: list[tuple]) -> bool:
        """Apply queued adds and aborts; returns whether anything was aborted."""
        engine = self.engine
        aborted = False
        for command in commands:
            if command[0] == "add":
                _, stream, request = command
                if stream.request_id in self._streams:
                    self._refuse(stream, ValueError(
                        f"request id {stream.request_id!r} is already in use"))
                    continue
                try:
                    engine.add_core_request(request)
                except (ValueError, TypeError) as exc:
                    self._refuse(stream, ValueError(str(exc)))
                    continue
                except Exception as exc:   # this request's data broke add_request: it alone
                    logger.exception("request %s: add_request failed", stream.request_id)
                    engine.abort_request(stream.request_id)    # drop whatever it left
                    self._refuse(stream, RuntimeError(f"the engine could not take the "
                                                      f"request: {exc!r}"))
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

    def _refuse(self, stream: _RequestStream, error: BaseException) -> None:
        """An add the engine did not take: give back its seqs, settle it with `error`."""
        self.release(stream.num_seqs)
        _resolve(stream, error)

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.time()
        for observer in self._observers:
            try:
                observer(outputs, now)
            except Exception:   # metrics must never stop the engine
                logger.exception("output observer failed")
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        released = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                released += stream.num_seqs
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        if released or not self._streams:    # sequences back before the clients know
            with self._cond:
                self._num_seqs -= released
                if not self._streams:
                    self._cond.notify_all()      # wait_until_idle() waits for this
        for loop, items in by_loop.items():
            _call_in_loop(loop, _put_all, items)

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
            self._refuse(stream, error)
        streams, self._streams = list(self._streams.values()), {}
        self._fail_streams(streams, error)
        # Nothing runs or waits any more: gauges must not keep the last step's numbers.
        self.snapshot = dataclasses.replace(self.snapshot, num_running=0, num_waiting=0,
                                            kv_cache_usage=0.0)

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
