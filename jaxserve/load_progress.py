"""How far this process is in loading a model: the phase and its fraction done.

The server listens while the engine loads (entrypoints/openai/serving_app.py), and its
readiness probe says why it is not ready yet: `{"status": "loading", "phase": "compile",
"progress": 0.43}`. Loading runs deep inside the engine's constructor, on one thread,
once per process, so the stages report to one process-wide tracker rather than threading
a callback through every layer; any layer may import this leaf module.

Phases, in order: "download" (weights from the Hub), "load" (read, convert and place the
weights), "compile" (warm-up's step buckets). `progress` is the fraction of the current
phase done, in [0, 1], or None where the phase cannot count its work.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PHASES = ("download", "load", "compile")


@dataclass(frozen=True, slots=True)
class LoadState:
    phase: str
    progress: float | None


class LoadProgress:
    """The latest phase reported; thread-safe (one writer, any readers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = LoadState("load", None)

    def report(self, phase: str, progress: float | None = None) -> None:
        """Enter (or advance within) `phase`; `progress` is clamped to [0, 1]."""
        if phase not in PHASES:
            raise ValueError(f"unknown load phase {phase!r}; one of {', '.join(PHASES)}")
        if progress is not None:
            progress = min(1.0, max(0.0, float(progress)))
        with self._lock:
            self._state = LoadState(phase, progress)

    def state(self) -> LoadState:
        with self._lock:
            return self._state


# The process's tracker: the engine's loading stages write it, the server reads it.
LOAD_PROGRESS = LoadProgress()


def report(phase: str, progress: float | None = None) -> None:
    """`LOAD_PROGRESS.report(phase, progress)`."""
    LOAD_PROGRESS.report(phase, progress)
