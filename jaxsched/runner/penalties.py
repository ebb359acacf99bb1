"""Host side of the sampler's penalties: each request's token history as a short, exact table.

vLLM's penalties need, per request, the output-token counts (presence and frequency penalties) and
the set of prompt-or-output tokens (repetition penalty). Sending that as an [S, V] array each step
would be the largest copy of the step; keeping counts on the device would need per-request device
state that survives preemption, swapping, prefix-cache hits and n > 1 forks. So each penalised
request sends a table of at most W distinct token ids with their output counts:

    penalty_ids    i32[S, W]  distinct token ids; entries past penalty_num are ignored
    penalty_counts f32[S, W]  output count of that token (0 for a prompt-only token);
                              MASKED (-1) = min_tokens not reached: the logit becomes -inf
    penalty_num    i32[S]     valid entries per row; 0 = the row has no penalties

An engine sizes W with table_capacity(): max_model_len (+ room for min_tokens' masked stop ids),
capped by the vocab. A request's distinct prompt + output tokens can never exceed max_model_len,
so every table fits and the penalties are exact for any max_tokens; check_penalty_capacity only
refuses the corner case of a request with more stop_token_ids to mask than that room.

The [S, W] tables are not part of the step's flat buffers: the runner sends them only in steps
where some row uses penalties, and otherwise passes tables already on the device (never read:
penalty_num is 0). A step with no penalised row also skips the stage on the device (lax.cond).
So requests without penalties pay nothing for them; a step with some copies 8 * W bytes per row
(S = 128, max_model_len 2048: 2 MiB), like vLLM's padded output-token history.

The tables are kept per request between steps and only the new output tokens are folded in, so the
host cost of a step is O(new tokens + W) per penalised request, never a pass over its history.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from jaxsched.core.request import Request, SamplingParams
from jaxsched.errors import InvalidRequestError

PENALTY_CAPACITY = 256  # W when none is given (tests); engines size it with table_capacity()
_MASK_ROOM = 32  # room for min_tokens' masked EOS / stop token ids beyond the history


def table_capacity(max_model_len: int, vocab_size: int) -> int:
    """W for an engine: a request's distinct prompt + output tokens never exceed max_model_len (nor
    the vocab), so with this W every table fits, whatever max_tokens is."""
    return min(vocab_size, max_model_len + _MASK_ROOM)
MASKED = -1.0  # penalty_counts value for a token masked by min_tokens


def tracks_outputs(params: SamplingParams) -> bool:
    """Whether the request's table counts its own outputs (a repetition, presence or frequency
    penalty); min_tokens alone masks tokens and counts nothing."""
    return _tracks(params)[1]


def _tracks(params: SamplingParams) -> tuple[bool, bool]:
    """(track the prompt, track the outputs) for these params."""
    rep = params.repetition_penalty != 1.0
    return rep, rep or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def masked_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """Tokens that min_tokens keeps from being sampled: EOS (unless ignore_eos) and stop_token_ids."""
    ids = dict.fromkeys(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(dict.fromkeys(eos_token_ids))
    return list(ids)


def max_penalty_entries(params: SamplingParams, prompt_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                        max_model_len: int, vocab_size: int) -> int:
    """An upper bound on the table entries this request can ever need."""
    if not params.uses_penalties:
        return 0
    track_prompt, track_outputs = _tracks(params)
    n_prompt = len(set(prompt_token_ids)) if track_prompt else 0
    max_new = max_model_len - len(prompt_token_ids)
    if params.max_tokens is not None:
        max_new = min(max_new, params.max_tokens)
    n_out = min(max(max_new, 0), vocab_size) if track_outputs else 0
    n_mask = len(masked_token_ids(params, eos_token_ids)) if params.min_tokens > 0 else 0
    return min(n_prompt + n_out + n_mask, vocab_size)


def check_penalty_capacity(params: SamplingParams, prompt_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                           max_model_len: int, vocab_size: int, capacity: int = PENALTY_CAPACITY) -> None:
    """Refuse a penalised request whose token table could outgrow `capacity` (InvalidRequestError)."""
    need = max_penalty_entries(params, prompt_token_ids, eos_token_ids, max_model_len, vocab_size)
    if need <= capacity:
        return
    track_prompt, _ = _tracks(params)
    n_prompt = len(set(prompt_token_ids)) if track_prompt else 0
    room = capacity - n_prompt - (len(masked_token_ids(params, eos_token_ids)) if params.min_tokens else 0)
    hint = (f"set max_tokens <= {room}" if room > 0 else
            "shorten the prompt or drop repetition_penalty (it tracks every distinct prompt token)")
    raise InvalidRequestError(
        f"penalties track at most {capacity} distinct tokens per request, and this one could need {need} "
        f"({n_prompt} distinct prompt tokens for repetition_penalty, plus one per output token up to max_tokens "
        f"or max_model_len): {hint}", "max_tokens" if room > 0 else "repetition_penalty"
    )


class _History:
    """One request's table: entries [0, size) of ids / counts, and where each token id sits."""

    __slots__ = ("counts", "ids", "index", "n_out", "request", "size")

    def __init__(self, request: Request, capacity: int) -> None:
        self.request = request
        self.ids = np.zeros(capacity, np.int32)
        self.counts = np.zeros(capacity, np.float32)
        self.index: dict[int, int] = {}
        self.size = 0
        self.n_out = 0  # output tokens folded in so far
        track_prompt, _ = _tracks(request.sampling_params)
        if track_prompt:
            uniq = np.unique(np.asarray(request.prompt_token_ids, np.int32))
            self._check(len(uniq))
            self.ids[: len(uniq)] = uniq
            self.index = dict(zip(uniq.tolist(), range(len(uniq))))
            self.size = len(uniq)

    def _check(self, size: int) -> None:
        if size > len(self.ids):  # check_penalty_capacity refuses such requests when they are made
            raise ValueError(f"request {self.request.request_id!r} needs more than {len(self.ids)} penalty "
                             "entries; it should have been refused by check_penalty_capacity")

    def add_outputs(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            j = self.index.get(t)
            if j is None:
                self._check(self.size + 1)
                j = self.index[t] = self.size
                self.ids[j] = t
                self.size += 1
            self.counts[j] += 1.0


class PenaltyTables:
    """Builds the penalty rows of each step's batch, keeping every penalised request's table."""

    def __init__(self, capacity: int = PENALTY_CAPACITY) -> None:
        self.capacity = capacity
        self._hist: dict[str, _History] = {}

    def __len__(self) -> int:
        return len(self._hist)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._hist.pop(rid, None)

    def fill_row(self, req: Request, ids_row: np.ndarray, counts_row: np.ndarray, num_outputs: int | None = None,
                 extra: Sequence[int] = ()) -> int:
        """Write req's table of the outputs read so far into one batch row (already zeroed); returns its
        number of entries. num_outputs: the outputs min_tokens counts, pending ones included (the
        row's output_index); by default those read. extra: outputs to count besides (speculative
        decoding: the proposals before the position this row samples at)."""
        params = req.sampling_params
        n_entries = 0
        _, track_outputs = _tracks(params)
        if track_outputs:
            h = self._hist.get(req.request_id)
            outs = req.output_token_ids
            if h is None or h.request is not req or h.n_out > len(outs):  # new, reused id, or rewound
                h = self._hist[req.request_id] = _History(req, self.capacity)
            if h.n_out < len(outs):
                h.add_outputs(outs[h.n_out :])
                h.n_out = len(outs)
            n_entries = h.size
            ids_row[:n_entries] = h.ids[:n_entries]
            counts_row[:n_entries] = h.counts[:n_entries]
            index = h.index
        else:
            index = {}
        added: dict[int, int] = {}  # the extra outputs' new entries (the request's own index stays as it is)
        for t in extra if track_outputs else ():
            j = index.get(t, added.get(t))
            if j is None:
                if n_entries >= len(ids_row):
                    raise ValueError(f"request {req.request_id!r} needs more than {len(ids_row)} penalty entries")
                j = added[t] = n_entries
                n_entries += 1
                ids_row[j], counts_row[j] = t, 0.0
            counts_row[j] += 1.0
        if (req.num_output_tokens if num_outputs is None else num_outputs) < params.min_tokens:
            for t in masked_token_ids(params, req.eos_token_ids):
                j = index.get(t, added.get(t))
                if j is None:
                    if n_entries >= len(ids_row):
                        raise ValueError(f"request {req.request_id!r} needs more than {len(ids_row)} penalty "
                                         "entries; it should have been refused by check_penalty_capacity")
                    j, n_entries = n_entries, n_entries + 1
                    ids_row[j] = t
                    added[t] = j
                counts_row[j] = MASKED
        return n_entries

    def prune(self, keep: Iterable[str], max_size: int) -> None:
        """Drop tables of requests not in `keep` once there are more than max_size (a request that
        leaves without being reported finished must not leak its table; a dropped one is rebuilt)."""
        if len(self._hist) > max_size:
            keep = set(keep)
            for rid in [r for r in self._hist if r not in keep]:
                del self._hist[rid]
