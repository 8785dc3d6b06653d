"""Waiting on a request's engine streams: all at once, until done, or until the client goes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from jaxserve.entrypoints.openai.errors import ClientGone
from jaxserve.outputs import RequestOutput

T = TypeVar("T")


MAX_CLIENT_REQUEST_ID_CHARS = 128  # longer x-request-id headers are cut (they go into logs)


def new_request_id(prefix: str, raw_request: Request | None = None,
                   separator: str = "-") -> tuple[str, str]:
    """(the response's id, the engine requests' id prefix): ``prefix``, ``separator``, then
    the client's x-request-id header if it sent one, else a random id. With the header both
    carry it (its log lines then show it); the engine's gets a random suffix, since two
    clients may send the same id."""
    given = raw_request.headers.get("x-request-id") if raw_request is not None else None
    cleaned = "".join(c for c in (given or "")[:MAX_CLIENT_REQUEST_ID_CHARS]
                      if c.isprintable() and not c.isspace())
    if not cleaned:
        request_id = f"{prefix}{separator}{uuid.uuid4().hex}"
        return request_id, request_id
    return (f"{prefix}{separator}{cleaned}",
            f"{prefix}{separator}{cleaned}-{uuid.uuid4().hex[:8]}")


async def until_disconnect(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (index of the iterator, item)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return

    async def next_item(stream: AsyncIterator[T]) -> T:
        return await stream.__anext__()

    pending = {asyncio.ensure_future(next_item(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(next_item(streams[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        if pending:     # let cancelled streams finish (and abort) before closing them
            await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def collect_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Drain request streams concurrently; the final RequestOutput of each, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]

