"""Tokenization off the event loop: a few worker threads, each with its own copy of the tokenizer.

Tokenizing a long prompt or rendering a chat template takes long enough to stall every other
connection if it ran on the event loop (a 1 MB prompt takes seconds), so the server hands that work
to these threads; a fast tokenizer releases the GIL while it encodes a batch, which transformers'
tokenizer calls do. A fast tokenizer must not be used by two threads at once (it fails with "Already
borrowed"), hence one copy per thread, made when the pool is built (before requests arrive, while
the output thread does not use the front end's own). The threads are daemons: a long task never holds up the
process's exit after a shutdown.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

R = TypeVar("R")


class TokenizerPool:
    def __init__(self, tokenizer: Any, workers: int = 2, name: str = "tokenize") -> None:
        try:
            copies = [copy.deepcopy(tokenizer) for _ in range(workers)]
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot be copied: one worker uses it
            logger.warning("cannot copy the tokenizer (%s): one %s worker shares it", e, name)
            copies = [tokenizer]
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for i, tok in enumerate(copies):
            threading.Thread(target=self._work, args=(tok,), name=f"jaxsched-{name}-{i}", daemon=True).start()

    def _work(self, tokenizer: Any) -> None:
        while True:
            fn, args, fut, loop = self._tasks.get()
            try:
                res, exc = fn(tokenizer, *args), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller's await
                res, exc = None, e
            try:
                loop.call_soon_threadsafe(resolve_future, fut, res, exc)
            except RuntimeError:  # the caller's loop is closed: nobody waits for this result
                pass

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        """fn(tokenizer, *args) on a worker thread, with that thread's tokenizer."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._tasks.put((fn, args, fut, loop))
        return await fut


def resolve_future(fut: asyncio.Future, res: Any, exc: BaseException | None) -> None:
    """Complete `fut` (on its loop) unless its waiter gave up."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)
