"""Why a request could not be served now: each maps to HTTP 503 in OpenAI's error shape.

`code` is the error's machine-readable reason (also the `reason` label of
`jaxserve:num_requests_rejected_total` for rejections); `retry_after` is the
`Retry-After` header in seconds, when a retry soon is likely to succeed.
"""

from __future__ import annotations


class EngineUnavailableError(RuntimeError):
    """The request cannot be served now (HTTP 503)."""

    code = "service_unavailable"
    retry_after: int | None = None


class EngineDeadError(EngineUnavailableError):
    """The engine thread failed for good or was shut down; no request can complete."""

    code = "engine_dead"


class ShuttingDownError(EngineDeadError):
    """The server is draining after SIGTERM: it takes no new request."""

    code = "shutting_down"


class StepFailedError(EngineUnavailableError):
    """The request was in an engine step that failed; the engine restarted in-process and a
    retry is served normally."""

    code = "engine_step_failed"
    retry_after = 1


class QueueFullError(EngineUnavailableError):
    """Admission control: the waiting queue is full (--max-queued-requests)."""

    code = "queue_full"
    retry_after = 1


class QueueTimeoutError(EngineUnavailableError):
    """The request waited longer than --max-queue-time without being scheduled."""

    code = "queue_timeout"
    retry_after = 1
