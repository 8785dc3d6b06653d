"""How a download shows its progress: one huggingface_hub tqdm bar for the whole model on a
terminal, a log line every ~10 % (bytes, rate, ETA) elsewhere (container logs), nothing when
INFO is not logged.

    progress = DownloadProgress(total_bytes=..., label="org/name@main")
    hf_hub_download(..., tqdm_class=progress.bar_class)      # for each file
    progress.close()
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from jaxserve import load_progress

logger = logging.getLogger(__name__)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


class ProgressLog:
    """Bytes of one model's download so far; logs at every tenth of `total` bytes."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._start: float | None = None     # when the first transfer began
        self._next_tenth = 1
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            if self._start is None:
                self._start = time.monotonic()

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self.done += num_bytes
            tenth = min(10, self.done * 10 // self.total)
            if tenth < self._next_tenth:
                return
            self._next_tenth = tenth + 1
            elapsed = max(time.monotonic() - (self._start or time.monotonic()), 1e-6)
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            logger.info("downloading %s: %d%% (%s of %s) at %s/s, ETA %.0f s", self.label,
                        tenth * 10, _gb(self.done), _gb(self.total), _gb(rate), eta)


class _TerminalBar:
    """One huggingface_hub tqdm bar over the whole model's bytes (not one per file)."""

    def __init__(self, total: int, label: str) -> None:
        from huggingface_hub.utils import tqdm as hf_tqdm

        self._bar = hf_tqdm(total=total, unit="B", unit_scale=True,
                            desc=label, dynamic_ncols=True)

    def started(self) -> None:
        pass

    def add(self, num_bytes: int) -> None:
        self._bar.update(num_bytes)

    def close(self) -> None:
        self._bar.close()


class _Quiet:
    """A sink that shows nothing (INFO not logged): the readiness probe still counts."""

    def started(self) -> None:
        pass

    def add(self, num_bytes: int) -> None:
        pass


class _ReadinessCount:
    """Forwards to a sink and reports the fraction done as the "download" load phase,
    which a listening server's /readyz shows (jaxserve/load_progress.py)."""

    def __init__(self, sink: ProgressLog | _TerminalBar | _Quiet, total: int) -> None:
        self._sink = sink
        self._total = max(total, 1)
        self._done = 0
        self._lock = threading.Lock()
        load_progress.report("download", 0.0)

    def started(self) -> None:
        self._sink.started()

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self._done += num_bytes
            done = self._done
        load_progress.report("download", done / self._total)
        self._sink.add(num_bytes)


def _forwarding_bar(sink: _ReadinessCount) -> type:
    class ForwardingBar:
        """What huggingface_hub's http_get asks of a tqdm class: each file's bytes go to
        the one model-wide sink (a log line every tenth, or one terminal bar)."""

        def __init__(self, *args: Any, initial: int = 0, **kwargs: Any) -> None:
            sink.started()
            if initial:
                sink.add(initial)

        def update(self, n: int | float = 1) -> None:
            sink.add(int(n))

        def close(self) -> None:
            pass

        def __enter__(self) -> ForwardingBar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return ForwardingBar


class DownloadProgress:
    """The ``tqdm_class`` to hand ``hf_hub_download`` for one model's files (``bar_class``;
    None: silent), and ``close()`` once they are all down."""

    def __init__(self, total_bytes: int, label: str) -> None:
        self._terminal: _TerminalBar | None = None
        sink: ProgressLog | _TerminalBar | _Quiet
        if not logger.isEnabledFor(logging.INFO):
            sink = _Quiet()
        elif sys.stderr.isatty():
            sink = self._terminal = _TerminalBar(total_bytes, label)
        else:
            sink = ProgressLog(total_bytes, label)
        self.bar_class: type = _forwarding_bar(_ReadinessCount(sink, total_bytes))

    def close(self) -> None:
        if self._terminal is not None:
            self._terminal.close()

