"""Token constraints: which tokens a request may sample next, as a row of the step's bitmask.

The sampler takes a fixed-shape i32[S, VW] bitmask each step (VW = ceil(V / 32); bit t % 32 of word
t // 32 allows token t; unconstrained rows are all ones) and gives disallowed tokens -inf inside the
jitted step (sampler.py), so constrained and free requests share one program. The host fills a row
per constrained request as the step is packed (batch.py), from the request's TokenConstraint:

- GrammarConstraint: an llguidance matcher (structured outputs: JSON Schema, regex, choice,
  grammar) that follows the request's accepted tokens. Its mask depends on the last token, so a
  step after one that sampled such a row waits for its tokens (engine.py, overlapped scheduling).
- AllowedTokens: vLLM's allowed_token_ids, one fixed row.

GrammarCompiler turns StructuredOutputsParams into a compiled grammar, cached by grammar text; the
tokenizer's llguidance form is built once, at the first grammar (about a second on the demo model).
A compile can be slow for a hostile schema: the server runs it on a worker thread with a time limit
before the request reaches the engine (serving/app.py), and hands the compiled grammar over with it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from jaxsched.errors import InvalidRequestError
from jaxsched.structured.params import PARAM, StructuredOutputsParams, first_line

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (each is a matcher and its lexer, a few MB at most)
# llguidance reads a grammar with native recursion, one level per rule or $ref in a chain: a
# chain of a few thousand (a ~100 KB schema, inside MAX_GRAMMAR_CHARS) overflows a thread's
# usual 8 MiB stack, and a stack overflow in native code kills the whole process. Compiles run on
# a thread with this much stack (reserved, touched only as deep as a compile goes), which holds
# the longest chain MAX_GRAMMAR_CHARS can spell with room to spare (tests/test_hostile.py).
COMPILE_STACK_BYTES = 512 << 20


def mask_words(vocab_size: int) -> int:
    """VW: int32 words of one row of the bitmask."""
    return (vocab_size + 31) // 32


class TokenConstraint:
    """One sequence's constraint on its next token."""

    depends_on_tokens = False  # whether the next mask depends on the token just sampled
    # the request field to blame when accept() refuses a token the mask allowed (the request's own
    # definition went past what the matcher can follow); None: an engine bug
    param: str | None = None

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed tokens into row i32[VW]."""
        raise NotImplementedError

    def accept(self, token: int) -> str | None:
        """Take the token the request sampled: None, or why the constraint cannot take it."""
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        """The constrained output is complete (nothing more may follow)."""
        return False

    def fork(self) -> TokenConstraint:
        """A copy for a sibling sample (n > 1) that follows its own tokens from here."""
        return self

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (speculative proposals) the constraint would take in order, its
        state left as it is: the proposals past them are cut before verification."""
        return len(tokens)

    def fill_ahead(self, rows: np.ndarray, tokens: Sequence[int]) -> None:
        """Speculative decoding: rows[j] (i32[VW] each) the mask after the first j of `tokens`
        (proposals it takes, valid_prefix), j = 0 .. len(rows) - 1, the last repeated past
        len(tokens); the state is left as it was (the step keeps only some of them)."""
        self.fill(rows[0])
        rows[1:] = rows[0]


class AllowedTokens(TokenConstraint):
    """vLLM's allowed_token_ids: the same row every step."""

    param = "allowed_token_ids"

    def __init__(self, ids: tuple[int, ...], vocab_size: int) -> None:
        self.ids = frozenset(ids)
        ids_ = np.fromiter(self.ids, np.int64, len(self.ids))
        row = np.zeros(mask_words(vocab_size), np.uint32)
        np.bitwise_or.at(row, ids_ // 32, (np.uint32(1) << (ids_ % 32).astype(np.uint32)))
        self.row = row.view(np.int32)

    def fill(self, row: np.ndarray) -> None:
        row[:] = self.row

    def accept(self, token: int) -> str | None:
        if token in self.ids:
            return None
        # the mask let through only ids outside the set: every allowed id was masked as well
        return ("no token of allowed_token_ids could be sampled here: min_tokens holds back the end-of-sequence "
                "and stop_token_ids tokens, and allowed_token_ids has no other; allow other tokens or lower "
                "min_tokens")


class GrammarConstraint(TokenConstraint):
    """An llguidance matcher over the request's output tokens.

    `banned` (the EOS ids of an ignore_eos request) are taken out of every mask unless nothing else
    is left: the grammar then goes on to max_tokens rather than ending where it could, and a
    grammar that can only end still ends."""

    depends_on_tokens = True
    param = PARAM

    def __init__(self, matcher: Any, banned: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.banned = banned

    def fill(self, row: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.after_fill(row)

    def after_fill(self, row: np.ndarray) -> None:
        if not self.banned:
            return
        kept = row.copy()
        bits = row.view(np.uint32)
        for t in self.banned:
            bits[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))
        if not row.any():
            row[:] = kept

    def accept(self, token: int) -> str | None:
        if self.matcher.consume_token(token):
            return None
        # llguidance's message goes on with pages of parser state: its first line says what broke
        return (f"the structured output's grammar could not follow token {token} ({first_line(self.matcher.get_error())}):"
                " the schema or grammar goes past the parser's limits here; simplify it")

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    def fork(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.deep_copy(), self.banned)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return int(self.matcher.validate_tokens(list(tokens))) if tokens else 0

    def fill_ahead(self, rows: np.ndarray, tokens: Sequence[int]) -> None:
        # the matcher walks through the proposals and back (llguidance's rollback): update() then
        # consumes only the tokens kept
        self.fill(rows[0])
        taken = 0
        for j, t in enumerate(tokens[: len(rows) - 1]):
            if not self.matcher.consume_token(t):  # valid_prefix cut what it refuses: not expected
                break
            taken += 1
            self.fill(rows[j + 1])
        rows[taken + 1 :] = rows[taken]
        if taken:
            self.matcher.rollback(taken)


def fill_rows(rows: list[tuple[TokenConstraint, int]], mask: np.ndarray, executor: Any = None) -> None:
    """Fill mask[i] for each (constraint, i); grammar rows in parallel on llguidance's threads
    (they release the GIL) when there are several."""
    grammars = [(c, i) for c, i in rows if isinstance(c, GrammarConstraint)]
    if executor is not None and len(grammars) > 1:
        assert mask.flags["C_CONTIGUOUS"]
        executor.unsafe_compute_mask_ptr([(c.matcher, i) for c, i in grammars], mask.ctypes.data, mask.shape[1] * 4,
                                         mask.shape[0])
        for c, i in grammars:
            c.after_fill(mask[i])
        rows = [(c, i) for c, i in rows if not isinstance(c, GrammarConstraint)]
    for c, i in rows:
        c.fill(mask[i])


class CompiledGrammar:
    """A grammar compiled for this tokenizer: a pristine matcher that each request copies."""

    def __init__(self, matcher: Any, text: str) -> None:
        self._matcher = matcher
        self.text = text

    def constraint(self, banned: tuple[int, ...] = ()) -> GrammarConstraint:
        return GrammarConstraint(self._matcher.deep_copy(), banned)


class GrammarCompiler:
    """StructuredOutputsParams -> CompiledGrammar, cached; thread-safe (the server compiles on
    worker threads, offline generation on the caller's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None)
                except Exception as e:  # e.g. a slow (Python) tokenizer
                    raise InvalidRequestError(f"structured outputs are not available for this model's tokenizer "
                                              f"({type(e).__name__}: {e})", PARAM) from e
            return self._ll_tokenizer

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for filling several rows at once (created on first use)."""
        with self._lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            return self._executor

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params`; raises InvalidRequestError (naming the field) for a
        definition that does not compile. The result is also kept on `params`, so that a request
        compiled ahead (on a server's worker thread) costs the engine's thread nothing."""
        own = params.__dict__.get("_compiled")
        if own is not None and own[0] is self:
            return own[1]
        compiled = self._compile(params)
        object.__setattr__(params, "_compiled", (self, compiled))  # frozen: a cache, not a field
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        text = _on_deep_stack(params.grammar_text)
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        import llguidance

        tokenizer = self.ll_tokenizer()

        def build() -> Any:
            matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
            if not matcher.is_error():
                # the first mask builds the lexer: here, on the compiling thread, not in a step
                matcher.unsafe_compute_mask_ptr(*_scratch_row(self.vocab_size))
            return matcher

        matcher = _on_deep_stack(build)
        if matcher.is_error():
            raise InvalidRequestError(f"the structured output's {params.kind} is not valid: "
                                      f"{first_line(matcher.get_error())}", f"{PARAM}.{params.kind}")
        compiled = CompiledGrammar(matcher, text)
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


class _DeepStackThreads:
    """A few long-lived threads with COMPILE_STACK_BYTES of stack, started together at first use
    (threading.stack_size is process-wide: it is set once, for them, not around every compile)."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self._jobs: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0

    def run(self, fn: Any) -> Any:
        """fn() on one of the threads (the caller waits): its result, or its exception."""
        self._start()
        job: Future = Future()
        self._jobs.put((fn, job))
        return job.result()

    def _start(self) -> None:
        with self._lock:
            if self._started == self.count:
                return
            before = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                while self._started < self.count:
                    threading.Thread(target=self._work, name=f"grammar-compile-{self._started}", daemon=True).start()
                    self._started += 1
            except RuntimeError as e:  # e.g. an address-space limit: no compile could then run safely
                if not self._started:
                    raise InvalidRequestError(f"structured outputs are not available: a compile thread with a "
                                              f"{COMPILE_STACK_BYTES >> 20} MiB stack could not start ({e})",
                                              PARAM) from e
                logger.warning("grammar compiles run on %d thread(s): another could not start (%s)", self._started, e)
                self.count = self._started
            finally:
                threading.stack_size(before)

    def _work(self) -> None:
        while True:
            fn, job = self._jobs.get()
            if not job.set_running_or_notify_cancel():
                continue
            try:
                job.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                job.set_exception(e)


_deep_stack = _DeepStackThreads()
_on_deep_stack = _deep_stack.run


_scratch = threading.local()


def _scratch_row(vocab_size: int) -> tuple[int, int]:
    row = getattr(_scratch, "row", None)
    if row is None or row.size != mask_words(vocab_size):
        row = _scratch.row = np.zeros(mask_words(vocab_size), np.int32)
    return row.ctypes.data, row.nbytes
