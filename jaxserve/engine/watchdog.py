"""A step watchdog: how long the engine thread's current iteration has been running.

The engine thread calls `begin()` before each iteration (admitting requests, one step) and
`end()` after; anyone may ask `busy_for()` from any thread, for the price of two attribute
reads, so GET /health can report a stalled step within seconds without touching the engine.
"""

from __future__ import annotations

import time


class StepWatchdog:
    __slots__ = ("_started",)

    def __init__(self) -> None:
        self._started: float | None = None     # monotonic start of the running iteration

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def busy_for(self) -> float:
        """Seconds the current iteration has run; 0.0 when the engine thread is idle."""
        started = self._started            # one read: the engine thread may clear it
        return 0.0 if started is None else time.monotonic() - started
