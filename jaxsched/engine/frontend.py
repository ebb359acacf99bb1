"""The front end: one service between the callers (LLM, LLMEngine, the HTTP and gRPC servers,
run-batch) and the engine cores, whatever runs them (core_client.py).

    make_request   a prompt (text, token ids) + SamplingParams -> a checked EngineCoreRequest: every
                   check a request gets, in one place, each error naming its field
    add            track its outputs, hand it to a core
    process        a core's EngineCoreOutputs -> RequestOutputs (output_processor.py: detokenizing,
                   stop strings, logprobs, n > 1 groups); samples ended by a stop string are
                   aborted in their core
    abort          end requests here and in their core

A FrontEnd is not thread-safe: one thread drives it (LLMEngine: the caller; the server: its lock,
serving/async_engine.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxsched.config import EngineConfig, ModelConfig
from jaxsched.core.kv_groups import kv_groups
from jaxsched.core.request import SamplingParams
from jaxsched.core.scheduler import check_fits
from jaxsched.engine.core_client import EngineCoreClient
from jaxsched.engine.core_messages import EngineCoreOutputs, EngineCoreRequest
from jaxsched.engine.output_processor import OutputProcessor
from jaxsched.engine.outputs import RequestOutput
from jaxsched.errors import InvalidRequestError
from jaxsched.runner.memory_report import MemoryReport
from jaxsched.runner.penalties import check_penalty_capacity

PromptType = str | dict[str, Any]
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def first_bad_token_id(ids: Sequence[Any], vocab_size: int) -> int:
    """The index of the first entry of `ids` that is no token id of the vocabulary (an int, not a
    bool, in [0, vocab_size)), or -1: the one rule every front end checks prompts by."""
    for i, t in enumerate(ids):
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab_size:
            return i
    return -1


@dataclass(frozen=True, slots=True)
class CheckedTokens:
    """A prompt of token ids its caller already checked with first_bad_token_id, off its event loop
    (the server, on a worker thread: a prompt may hold max_model_len ids), which make_request then
    takes without walking them again."""

    ids: list[int]
    text: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A checked request: what its core gets, and the prompt's text (outputs repeat it; cores never see it)."""

    core: EngineCoreRequest
    prompt: str | None = None

    @property
    def request_id(self) -> str:
        return self.core.request_id


class FrontEnd:
    def __init__(self, client: EngineCoreClient, tokenizer: Any = None, grammars: Any = None) -> None:
        """tokenizer / grammars: an in-process core's own (its compiled grammars are then shared);
        None loads the tokenizer from the config and compiles grammars here."""
        from jaxsched.engine.tokenizer import load_tokenizer
        from jaxsched.structured.grammar import GrammarCompiler

        self.client = client
        self.config: EngineConfig = client.config
        self.info = client.info
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.config.tokenizer_path)
        self.eos_token_ids = tuple(client.info.eos_token_ids)
        self.grammars = grammars if grammars is not None else GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self._rng = np.random.default_rng(self.config.seed)
        self._next_id = 0

    @property
    def model_config(self) -> ModelConfig:
        """The checkpoint's architecture (head counts as in its config.json)."""
        return self.config.checkpoint_model

    @property
    def cache_config(self):
        return self.config.cache

    @property
    def scheduler_config(self):
        return self.config.scheduler

    def kv_bytes_per_device(self) -> int:
        return self.info.kv_bytes_per_device

    def memory_report(self) -> MemoryReport:
        """Where the memory of one device of the (first) core went (runner/memory_report.py)."""
        return self.info.memory

    # -- requests in ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType | Sequence[int]) -> tuple[list[int], str | None]:
        """A prompt as token ids (+ its text). Raises InvalidRequestError on an empty or malformed prompt."""
        if isinstance(prompt, CheckedTokens):
            if not prompt.ids:
                raise InvalidRequestError("prompt_token_ids is empty: pass at least one token id", "prompt")
            return prompt.ids, prompt.text
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: pass at least one character or token id", "prompt")
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise InvalidRequestError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)",
                                          "prompt")
        elif isinstance(prompt, (list, tuple)):
            ids, text = prompt, None
        else:
            raise InvalidRequestError(
                f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}", "prompt")
        V = self.model_config.vocab_size
        ids = list(ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids is empty: pass at least one token id", "prompt")
        if (bad := first_bad_token_id(ids, V)) >= 0:
            raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {V}) (the vocab size), got {ids[bad]!r}",
                                      "prompt")
        return [int(t) for t in ids], text

    def make_request(self, request_id: str, prompt: PromptType | Sequence[int],
                     params: SamplingParams | None = None, arrival_time: float | None = None,
                     priority: int = 0, timeout: float | None = None,
                     queue_timeout: float | None = None) -> NewRequest:
        """Check a request and build what its core gets, without adding it (so a batch can be
        checked up front). Every check a request gets is here (the server's own are about the
        HTTP request's shape), each raising InvalidRequestError that names the field. timeout:
        seconds after arrival when the core ends it (finish reason "timeout"); queue_timeout:
        seconds after arrival when the core ends it if it has not started ("queue_timeout")."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}", "sampling_params")
        if not isinstance(priority, int) or isinstance(priority, bool) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequestError(f"priority must be a 64-bit integer (lower runs first), got {priority!r}",
                                      "priority")
        cfg = self.config
        if params.prompt_logprobs is not None and params.prompt_logprobs > cfg.max_logprobs:
            raise InvalidRequestError(
                f"prompt_logprobs must be <= max_logprobs ({cfg.max_logprobs}), got {params.prompt_logprobs}",
                "prompt_logprobs")
        if params.logprobs is not None and params.logprobs > cfg.max_logprobs:
            raise InvalidRequestError(
                f"logprobs must be <= max_logprobs ({cfg.max_logprobs}), got {params.logprobs}", "logprobs")
        V = self.model_config.vocab_size
        for name, what, ids in (("stop_token_ids", "stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids),
                                ("logit_bias", "logit_bias keys", [t for t, _ in params.logit_bias or ()])):
            if ids and (t := max(ids)) >= V:  # (checked >= 0 in SamplingParams; max runs in C)
                raise InvalidRequestError(f"{what} must be token ids in [0, {V}) (the vocab size), got {t}", name)
        if params.top_k > V:  # keeps every token, as top_k = 0 does (vLLM clamps it to the vocab too)
            params = dataclasses.replace(params, top_k=0)
        ids, text = self.tokenize_prompt(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else getattr(prompt, "cache_salt", None)
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        check_penalty_capacity(params, ids, self.eos_token_ids, cfg.scheduler.max_model_len, V, cfg.penalty_capacity)
        check_satisfiable(params, self.eos_token_ids)
        check_fits(len(ids), params.max_tokens, cfg.scheduler, cfg.cache.block_size, cfg.cache.num_usable_blocks,
                   kv_groups(cfg.model))
        if params.structured_outputs is not None:  # a definition that does not compile is refused here
            self.grammars.compile(params.structured_outputs)
        for name, seconds in (("timeout", timeout), ("queue_timeout", queue_timeout)):
            if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                        or not 0 < seconds < 1e9):
                raise InvalidRequestError(f"{name} must be a number of seconds > 0, got {seconds!r}", name)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core = EngineCoreRequest(
            request_id, ids, params, arrival, priority,
            sample_seed=seed % (2**31 - 1),
            # prefix caching: requests share cached blocks only with requests of the same salt
            cache_salt=int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") if salt else 0,
            deadline=None if timeout is None else arrival + timeout,
            queue_deadline=None if queue_timeout is None else arrival + queue_timeout)
        return NewRequest(core, text)

    def add(self, req: NewRequest) -> None:
        """Queue a checked request (make_request). With n > 1 its samples run as sibling requests in
        one core, sharing the prompt's KV blocks; all are queued or none is."""
        self.outputs.add(req.core, req.prompt)  # refuses an id (or a sample's id) already in flight
        try:
            self.client.add_request(req.core)
        except BaseException:
            self.outputs.forget(req.request_id)
            raise

    def abort(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """End requests (an n > 1 request, or any of its samples, ends all its samples): their final
        outputs, finish_reason "abort". Unknown ids are ignored."""
        outputs, running = self.outputs.abort(request_ids)
        self.client.abort_requests(running)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    def next_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    # -- outputs -------------------------------------------------------------------------------
    def process(self, outs: EngineCoreOutputs) -> list[RequestOutput]:
        """The RequestOutputs of a core's message; a sample whose text reached a stop string is
        aborted in its core."""
        outputs, ended = self.outputs.process(outs.outputs)
        if ended:
            self.client.abort_requests(ended)
        return outputs


def check_satisfiable(params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
    """Refuse constraints that exclude each other, found before the request runs. min_tokens holds
    back the end-of-sequence and stop_token_ids tokens for the first min_tokens tokens: allowed ids
    that are all of those, or choices too short to last that long (a token is at least one byte),
    leave nothing to sample. What only sampling can find ends the request with an error naming the
    fields (AllowedTokens.accept, the grammar's)."""
    if params.min_tokens <= 0:
        return
    held = set(params.stop_token_ids) | set(eos_token_ids)
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) <= len(held) and held.issuperset(allowed):
        raise InvalidRequestError(
            f"every id of allowed_token_ids is an end-of-sequence or stop_token_ids token, which min_tokens = "
            f"{params.min_tokens} holds back: nothing could be sampled; allow other tokens or set min_tokens to 0",
            "allowed_token_ids")
    so = params.structured_outputs
    if so is not None and so.choice is not None:
        longest = max(len(c.encode()) for c in so.choice)
        if longest < params.min_tokens:
            raise InvalidRequestError(
                f"min_tokens = {params.min_tokens} but the longest structured_outputs.choice is {longest} bytes, "
                "at most that many tokens: the request could never end; lower min_tokens",
                "min_tokens")
