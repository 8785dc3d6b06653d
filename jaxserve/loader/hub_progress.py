"""How a download shows its progress: huggingface_hub's bar on a terminal, a log line every
~10 % (bytes, rate, ETA) elsewhere (container logs), nothing when INFO is not logged.

    bar_class = progress_bar_class(total_bytes=..., label="org/name")
    hf_hub_download(..., tqdm_class=bar_class)
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


class ProgressLog:
    """Bytes of one model's download so far; logs at every tenth of `total` bytes."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._start = time.monotonic()
        self._next_tenth = 1
        self._lock = threading.Lock()

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self.done += num_bytes
            tenth = min(10, self.done * 10 // self.total)
            if tenth < self._next_tenth:
                return
            self._next_tenth = tenth + 1
            elapsed = max(time.monotonic() - self._start, 1e-6)
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            logger.info("downloading %s: %d%% (%s of %s) at %s/s, ETA %.0f s", self.label,
                        tenth * 10, _gb(self.done), _gb(self.total), _gb(rate), eta)


def _logging_bar(progress: ProgressLog) -> type:
    class LoggingBar:
        """What huggingface_hub's http_get asks of a tqdm class, writing log lines instead."""

        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any) -> None:
            if initial:
                progress.add(initial)

        def update(self, n: int | float = 1) -> None:
            progress.add(int(n))

        def close(self) -> None:
            pass

        def __enter__(self) -> LoggingBar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return LoggingBar


def _silent_bar() -> type:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class SilentBar(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentBar


def progress_bar_class(total_bytes: int, label: str) -> type | None:
    """The ``tqdm_class`` for ``hf_hub_download``: None (huggingface_hub's own bar) on a
    terminal, a class logging every ~10 % elsewhere, a silent one below INFO."""
    if not logger.isEnabledFor(logging.INFO):
        return _silent_bar()
    if sys.stderr.isatty():
        return None
    return _logging_bar(ProgressLog(total_bytes, label))
