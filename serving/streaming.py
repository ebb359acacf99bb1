"""Streaming helpers: Server-Sent Events that abort on disconnect, and several streams merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from jaxsched.engine.outputs import RequestOutput

_enc = msgspec.json.Encoder()


class EventStream:
    """An SSE response that aborts its requests when the client disconnects: the body is produced
    by one task while another waits for http.disconnect; whichever ends first stops the other, and
    closing the chunk generator closes its engine streams."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(produce()), asyncio.ensure_future(disconnected())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.chunks.aclose()  # type: ignore[attr-defined]


def sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


async def merge(streams: Sequence[Any]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                i = pending.pop(t)
                try:
                    out = t.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for t in pending:
            t.cancel()
