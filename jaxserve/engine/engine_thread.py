"""The engine thread of `AsyncLLMEngine`: the only caller of the engine core.

It sleeps until the inbox has commands or the core has work, applies the commands
(add, finish, abort), steps, and hands each step's outputs to the requests' streams on
their event loops. A failed step fails the requests it had scheduled and rebuilds the
core in-process (`_recover`); one failure too many, or any error escaping that, fails
every request (`_fail_all`), so no client is left waiting.

`EngineThread` owns that state. The asyncio side touches it only through its public
methods: `send` puts a command in the inbox (`_cond` guards the inbox and the lifecycle
flags), `wait_until_idle`, `stop`. `_streams` (request id -> RequestStream) is touched by
the engine thread only. Admitted sequences are counted by `Admission` (admission.py): the
asyncio side reserves them, this thread gives them back as requests end.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxserve.engine.admission import Admission
from jaxserve.engine.engine_io import EngineCoreOutput
from jaxserve.engine.errors import (
    EngineDeadError,
    QueueTimeoutError,
    ShuttingDownError,
    StepFailedError,
)
from jaxserve.engine.protocol import EngineCoreInterface
from jaxserve.engine.request_stream import (
    RequestStream,
    call_in_loop,
    put_all,
    resolve_accepted,
)
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.engine.watchdog import StepWatchdog

logger = logging.getLogger(__name__)

# How often the engine thread looks for requests past --max-queue-time (seconds).
_QUEUE_TIME_CHECK_INTERVAL = 0.1

# Observer of every step's outputs, called on the engine thread: (outputs, wall time).
OutputObserver = Callable[[list[EngineCoreOutput], float], None]


class EngineThread:
    """The thread that steps an engine core, its inbox, and the streams it feeds."""

    def __init__(self, engine_core: EngineCoreInterface, admission: Admission) -> None:
        self.engine_core = engine_core
        self.admission = admission
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._streams: dict[str, RequestStream] = {}     # touched by the engine thread only
        self._accepting = True
        self._stopping = False
        self._dead: BaseException | None = None
        self._observers: list[OutputObserver] = []
        self._failure_observers: list[Callable[[list[str]], None]] = []
        self.snapshot: EngineSnapshot = engine_core.snapshot()
        self.last_step_time = time.monotonic()
        self.watchdog = StepWatchdog()       # how long the current iteration has run (/health)
        # Fault recovery (async_engine.py's docstring): restarts allowed in a row, and who to
        # tell when the engine is dead for good (the server exits non-zero).
        self.max_restarts = 3
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.num_restarts = 0                 # in-process restarts since start
        self._consecutive_failures = 0
        self.recovering: str | None = None    # why, while a restart is under way
        self.max_queue_time: float | None = None   # seconds a request may stay unscheduled
        self._next_queue_check = 0.0
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    # -- any thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._publish_snapshot()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def accepting(self) -> bool:
        """New requests are taken (False once a drain or shutdown began)."""
        return self._accepting and not self._stopping

    def add_output_observer(self, observer: OutputObserver) -> None:
        """Call `observer(outputs, now)` on the engine thread after every step (metrics)."""
        self._observers.append(observer)

    def add_failure_observer(self, observer: Callable[[list[str]], None]) -> None:
        """Call `observer(request_ids)` on the engine thread for requests that end with an
        error instead of a final output (a failed step, a queue timeout)."""
        self._failure_observers.append(observer)

    def send(self, command: tuple, force: bool = False) -> None:
        """Queue a command for the engine thread: ("add", stream, request), ("finish",
        [(request id, index)]), ("abort", request id), ("abort_all",). Without `force`,
        refused (ShuttingDownError) once the engine stopped accepting."""
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is dead: {self._dead!r}")
            if not force and not self._accepting:
                raise ShuttingDownError("the server is shutting down")
            self._inbox.append(command)
            self._cond.notify()

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

    def stop(self, join_timeout: float) -> None:
        """Abort what is in flight, end the thread, and wait up to `join_timeout` s for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", join_timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread: one iteration (commands, then a step) while not stopping.
        Any failure that escapes recovery fails every client; none is left waiting."""
        try:
            while self._iterate():
                pass
        except BaseException as exc:
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

    def _iterate(self) -> bool:
        """Sleep until there is work; apply the inbox; step once. False: stop the thread."""
        engine = self.engine_core
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
            return False
        if self.max_queue_time is not None:
            aborted |= self._expire_queued()
        # After an abort, step even if the engine says it is idle: the aborted
        # request's final output comes out of the next step().
        if aborted or engine.has_unfinished_requests():
            try:
                outputs = engine.step()
            except Exception as exc:
                self._recover(exc)      # raises once the restarts are used up
                self.watchdog.end()
                return True
            self._consecutive_failures = 0
            self.last_step_time = time.monotonic()
            self._dispatch(outputs)
            self._publish_snapshot()
        self.watchdog.end()
        return True

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
        self.recovering = f"recovering from a failed engine step: {exc!r}"
        engine = self.engine_core
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
                engine.add_request(stream.request)
            except Exception as add_exc:
                self._fail_streams([stream], StepFailedError(
                    f"could not re-queue the request after an engine restart: {add_exc!r}"))
                continue
            self._streams[stream.request_id] = stream
        self._publish_snapshot()
        self.recovering = None
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
        expired = [rid for rid, arrival in self.engine_core.unscheduled_requests().items()
                   if arrival < cutoff and rid in self._streams]
        if not expired:
            return False
        self.engine_core.abort_request(expired)
        self.admission.count_rejected(QueueTimeoutError.code, len(expired))
        self._fail_streams([self._streams.pop(rid) for rid in expired], QueueTimeoutError(
            f"the request waited more than {self.max_queue_time:g} s (--max-queue-time) "
            "without being scheduled: retry later"))
        return True

    def _fail_streams(self, streams: list[RequestStream], error: BaseException) -> None:
        """End streams (already out of _streams) with `error`; give back their sequences."""
        if not streams:
            return
        self.admission.release(sum(stream.num_seqs for stream in streams))   # before clients know
        for stream in streams:
            call_in_loop(stream.loop, stream.queue.put_nowait, error)
        _notify(self._failure_observers, "failure", [stream.request_id for stream in streams])

    def _handle_commands(self, commands: list[tuple]) -> bool:
        """Apply queued adds and aborts; returns whether anything was aborted."""
        engine = self.engine_core
        aborted = False
        for command in commands:
            if command[0] == "add":
                _, stream, request = command
                if stream.request_id in self._streams:
                    self._refuse(stream, ValueError(
                        f"request id {stream.request_id!r} is already in use"))
                    continue
                try:
                    engine.add_request(request)
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
                resolve_accepted(stream, None)
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

    def _refuse(self, stream: RequestStream, error: BaseException) -> None:
        """An add the engine did not take: give back its seqs, settle it with `error`."""
        self.admission.release(stream.num_seqs)
        resolve_accepted(stream, error)

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        _notify(self._observers, "output", outputs, time.time())
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
        self.admission.release(released)     # sequences back before the clients know
        if not self._streams:
            with self._cond:
                self._cond.notify_all()          # wait_until_idle() waits for this
        for loop, items in by_loop.items():
            call_in_loop(loop, put_all, items)

    def _abort_all(self) -> None:
        """Abort every in-flight request and deliver its final output (shutdown)."""
        engine = self.engine_core
        if self._streams:
            logger.info("aborting %d in-flight request(s)", len(self._streams))
            engine.abort_request(list(self._streams))
            for _ in range(1000):
                self._dispatch(engine.step())
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
        self.snapshot = self.engine_core.snapshot()


def _notify(observers: list[Callable[..., None]], kind: str, *args: Any) -> None:
    """Call every observer; one that raises is logged: metrics never stop the engine."""
    for observer in observers:
        try:
            observer(*args)
        except Exception:
            logger.exception("%s observer failed", kind)
