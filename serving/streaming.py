"""Streaming helpers: cumulative outputs to deltas, and Server-Sent Events that abort on disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from jaxsched.outputs import CompletionOutput, Logprob, RequestOutput

_enc = msgspec.json.Encoder()


@dataclass
class CompletionDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class DeltaTracker:
    """Turns one request's cumulative CompletionOutputs into what is new since the last call.

    While a completion runs, its last max(len(stop)) - 1 characters are held back: they could be the
    start of a stop string, which would be cut from the text. Tokens and logprobs are not held back.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self._sent: dict[int, tuple[int, int, int]] = {}  # index -> (chars, tokens, logprobs) sent

    def delta(self, comp: CompletionOutput) -> CompletionDelta:
        chars, toks, lps = self._sent.get(comp.index, (0, 0, 0))
        finished = comp.finish_reason is not None
        end = len(comp.text) if finished else max(chars, len(comp.text) - self.holdback)
        logprobs = comp.logprobs[lps:] if comp.logprobs is not None else None
        self._sent[comp.index] = (end, len(comp.token_ids), len(comp.logprobs or ()))
        return CompletionDelta(comp.index, comp.text[chars:end], comp.token_ids[toks:], logprobs,
                               comp.finish_reason, comp.stop_reason)


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
