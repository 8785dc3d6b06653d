"""Where one request's outputs go: a queue on the caller's event loop, fed from the engine
thread only through `loop.call_soon_threadsafe`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from jaxserve.engine.request_text import RequestText


class RequestStream:
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


def put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def resolve_accepted(stream: RequestStream, error: BaseException | None) -> None:
    """Settle a stream's `accepted` future from the engine thread."""
    def settle() -> None:
        if stream.accepted.done():
            return
        if error is None:
            stream.accepted.set_result(None)
        else:
            stream.accepted.set_exception(error)
    call_in_loop(stream.loop, settle)


def call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:            # the caller's loop is closed: nobody is listening
        pass
