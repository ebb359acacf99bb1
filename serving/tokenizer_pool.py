"""Tokenization off the event loop: a few worker threads, each with its own copy of the tokenizer.

Tokenizing a long prompt or rendering a chat template takes long enough to stall every other
connection if it ran on the event loop (a 1 MB prompt takes seconds), so the server hands that work
to these threads; a fast tokenizer releases the GIL while it encodes a batch, which
transformers' tokenizer calls do. A fast tokenizer must not be used by two threads at once (it
fails with "Already borrowed"), hence one copy per thread, made on the thread's first task.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

R = TypeVar("R")


class TokenizerPool:
    def __init__(self, tokenizer: Any, workers: int = 2) -> None:
        self._proto = tokenizer
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxsched-tokenize")

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:  # the prototype is only ever read, and by one thread at a time
                tok = self._local.tokenizer = copy.deepcopy(self._proto)
        return tok

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        """fn(tokenizer, *args) on a worker thread, with that thread's tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._tokenizer(), *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
