"""Admission control for the server: how many sequences may be unfinished at once.

The asyncio side reserves sequences before it submits a request (`reserve`, or
`QueueFullError` at the cap); whoever ends the request gives them back (`release`): the
engine thread when its final output or an error goes out, the asyncio side when a
request never reached the engine. Thread-safe; its own lock guards its own counts.
"""

from __future__ import annotations

import collections
import threading

from jaxserve.engine.errors import QueueFullError


class Admission:
    """Unfinished sequences admitted, their cap, and requests refused (by reason)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.max_unfinished_seqs: int | None = None      # None: no cap
        self._num_seqs = 0
        self.num_rejected: collections.Counter[str] = collections.Counter()   # by error code

    @property
    def num_unfinished_seqs(self) -> int:
        return self._num_seqs

    def has_room(self, num_seqs: int = 1) -> bool:
        """`num_seqs` more sequences would be admitted now."""
        cap = self.max_unfinished_seqs
        return cap is None or self._num_seqs + num_seqs <= cap

    def reserve(self, num_seqs: int) -> None:
        """Admit `num_seqs` sequences, or raise QueueFullError (counted) at the cap."""
        with self._lock:
            cap = self.max_unfinished_seqs
            if cap is not None and self._num_seqs + num_seqs > cap:
                self.num_rejected[QueueFullError.code] += 1
                raise QueueFullError(
                    f"the server is at capacity ({self._num_seqs} sequences in flight or "
                    f"queued; the limit is {cap}): retry later")
            self._num_seqs += num_seqs

    def release(self, num_seqs: int) -> None:
        """Give back admitted sequences."""
        if num_seqs:
            with self._lock:
                self._num_seqs -= num_seqs

    def count_rejected(self, code: str, num_requests: int) -> None:
        """Requests that ended refused for reason `code` after admission (a queue timeout)."""
        with self._lock:
            self.num_rejected[code] += num_requests
