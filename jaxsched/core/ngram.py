"""N-gram proposals (prompt lookup), for speculative decoding. Plain numpy on the host: no jax here.

A request's next tokens are guessed from its own history: find the last earlier place where its
last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred in its prompt and output,
and propose the tokens that followed there. Outputs that copy their prompt (editing, retrieval,
code) are guessed well; the step verifies every proposal against the model, so a bad guess costs
only the verification's share of the step (the scheduler sizes that: speculation.py).

Each request's history is kept in a numpy array grown as its tokens come (amortised doubling), so
a proposal costs one vectorised comparison over the history, not a Python loop per token.
"""

from __future__ import annotations

import numpy as np

from jaxsched.core.request import Request


class NgramProposer:
    on_device = False  # the proposals are known when the step is scheduled (draft_slots.py: not so)

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._history: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (tokens buffer, tokens in it)

    def _tokens(self, req: Request) -> np.ndarray:
        """The request's prompt + output tokens as an int64 array (a view of its kept buffer)."""
        n = req.num_tokens
        buf, have = self._history.get(req.request_id, (None, 0))
        if buf is None or have > n:  # new, or its output was cut back (never, today): start again
            buf, have = np.empty(max(64, 2 * n), np.int64), 0
        if n > buf.size:
            buf = np.concatenate([buf[:have], np.empty(2 * n - have, np.int64)])
        if have < n:
            buf[have:n] = req.token_slice(have, n)
        self._history[req.request_id] = (buf, n)
        return buf[:n]

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k tokens to follow the request's tokens so far ([] when no n-gram recurs)."""
        if k <= 0:
            return []
        toks = self._tokens(req)
        L = toks.size
        for n in range(min(self.lookup_max, L - 1), self.lookup_min - 1, -1):
            pattern = toks[L - n:]
            # starts i of earlier occurrences, each followed by at least one token: i + n < L
            cand = np.flatnonzero(toks[: L - n] == pattern[0])
            for j in range(1, n):
                if not cand.size:
                    break
                cand = cand[toks[cand + j] == pattern[j]]
            if cand.size:
                # the latest occurrence followed by k tokens, else the latest (a repeat right
                # before the suffix has only a few tokens after it)
                full = cand[cand + n + k <= L]
                i = int(full[-1] if full.size else cand[-1]) + n
                return toks[i : i + k].tolist()
        return []

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._history.pop(rid, None)
