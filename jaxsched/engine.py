"""LLMEngine, the synchronous step loop (LLM, offline generation on top of it, is in llm.py).

What runs each step (LLMEngine.step):
    out     = scheduler.schedule()          who runs, how many tokens each, which buckets
    batch   = packer.pack(out, blocks)      fixed-shape arrays for the device
    sampled = runner.execute(batch)         one jitted call: model + sampler
    got     = scheduler.update(out, ids)    append tokens, stop checks, free finished blocks
then detokenize, apply stop strings, and report RequestOutputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxsched.batch import BatchPacker
from jaxsched.block_manager import BlockManager, cdiv
from jaxsched.buckets import seq_buckets, token_buckets
from jaxsched.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig, default_block_size
from jaxsched.detokenizer import IncrementalDetokenizer
from jaxsched.models.loader import build_model, forget_gguf_readers, load_model_source
from jaxsched.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxsched.penalties import check_penalty_capacity, table_capacity
from jaxsched.request import Request, RequestStatus, SamplingParams
from jaxsched.runner import ModelRunner, kv_bytes_per_block, num_blocks_for_memory
from jaxsched.sampler import SamplerOutput
from jaxsched.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

PromptType = str | dict[str, Any]
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def resolve_configs(args: EngineArgs, model_cfg: ModelConfig, platform: str) -> tuple[str, SchedulerConfig]:
    """Derive the dtype and the scheduler config from the engine args and the model."""
    dtype = args.dtype
    if dtype == "auto":
        # XLA:CPU runs float32 matmuls faster than bfloat16 ones; accelerators get the checkpoint's
        # 16-bit dtype (float16 checkpoints run in bfloat16, which has float32's range).
        dtype = "float32" if platform == "cpu" or model_cfg.dtype in ("float32", "float64") else "bfloat16"
    max_len = args.max_model_len or model_cfg.max_position_embeddings
    if max_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_len}) is larger than the model's max_position_embeddings "
            f"({model_cfg.max_position_embeddings}); lower max_model_len"
        )
    if model_cfg.sliding_window is not None and max_len > model_cfg.sliding_window:
        raise ValueError(
            f"the model uses sliding-window attention (window {model_cfg.sliding_window}), which this engine "
            f"does not implement; set max_model_len <= {model_cfg.sliding_window}"
        )
    if args.enable_chunked_prefill:
        budget = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    else:
        budget = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_len, args.max_num_seqs)
        if budget < max_len:
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens ({budget}) must be >= "
                f"max_model_len ({max_len}) so that any prompt fits in one step"
            )
    max_seqs = min(args.max_num_seqs, budget)
    sched = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        token_buckets=token_buckets(budget, max_seqs),
        seq_buckets=seq_buckets(max_seqs),
        preemption_mode=args.preemption_mode,
        swap_threshold=args.swap_threshold,
        max_paddings=args.max_paddings,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_queued_requests=args.max_num_queued_requests,
    )
    return dtype, sched


def swap_min_tokens(cfg: ModelConfig, dtype: str, platform: str) -> int:
    """Context length from which swapping a victim out and back costs less than recomputing it.

    Recompute costs about 2 * params FLOPs per token (plus attention, ignored: it only favours
    swapping further); a swap copies each token's K/V out and back over the host link, plus a
    fixed cost per swap (two copy calls and the scheduling around them). Rates are coarse
    per-platform figures; the decision only needs their order of magnitude.
    """
    flops, link_bw, overhead_s = (2e14, 2e10, 2e-3) if platform == "gpu" else (1e11, 5e9, 2e-3)
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    qkvo = D * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim * 2
    params = L * (qkvo + 3 * D * F) + V * D
    recompute = 2 * params / flops
    itemsize = 2 if dtype == "bfloat16" else 4
    copy = 2 * 2 * L * cfg.num_kv_heads * cfg.head_dim * itemsize / link_bw
    if recompute <= copy:
        return 1 << 30  # never worth it: always recompute
    return max(1, int(overhead_s / (recompute - copy)) + 1)


class _RequestState:
    """Engine-side extras of a request: detokenizer and logprobs."""

    __slots__ = ("cumulative_logprob", "detok", "logprobs", "request")

    def __init__(self, request: Request, detok: IncrementalDetokenizer) -> None:
        self.request = request
        self.detok = detok
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0


class _Group:
    """An n > 1 request: its samples run as sibling Requests; outputs are reported together."""

    __slots__ = ("child_ids", "children", "completions", "parent")

    def __init__(self, parent: Request, children: list[Request]) -> None:
        self.parent = parent
        self.children = children
        self.child_ids = [c.request_id for c in children]
        self.completions: list[CompletionOutput | None] = [None] * len(children)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request: distinct per sample, reproducible per seed."""
    return (seed + index * 0x9E3779B1) % (2**31 - 1)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        import jax
        from flax import nnx

        args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
        self.args = args
        path = args.model
        if path is None:
            from jaxsched.models.demo import demo_model_path

            path = str(demo_model_path())
        self.model_path = path
        model_cfg, getter, _kind = load_model_source(path)
        platform = jax.devices()[0].platform
        dtype, sched_cfg = resolve_configs(args, model_cfg, platform)
        self.model_config = model_cfg
        self.scheduler_config = sched_cfg
        self.dtype = dtype

        from jaxsched.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(args.tokenizer or path)
        t0 = time.perf_counter()
        backend = args.attention_backend
        auto = backend == "auto"
        if auto:
            backend = "pallas" if platform == "gpu" else "numba"
        if backend == "numba":
            from pallas_kernels.numba_attention import unsupported_reason as numba_unsupported

            why = numba_unsupported()
            if why is not None and not auto:
                raise ValueError(f"attention_backend='numba' cannot run here: {why}; use attention_backend='xla' "
                                 "or 'auto'")
            if why is not None:
                logger.warning("attention_backend auto: using 'xla' because %s", why)
                backend = "xla"
        if backend == "pallas" and auto:
            from pallas_kernels.pallas_attention import unsupported_reason

            why = unsupported_reason(model_cfg.head_dim, args.block_size or default_block_size("pallas"), dtype)
            if why is not None:
                logger.warning("attention_backend auto: using 'xla' because %s", why)
                backend = "xla"
        self.attention_backend = backend
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        if kv_dtype != dtype and backend == "pallas":
            raise ValueError(
                f"kv_cache_dtype {kv_dtype!r} differs from the model dtype {dtype!r}, which only "
                "the 'numba' and 'xla' attention backends support; use kv_cache_dtype='auto' or attention_backend='numba'"
            )
        model = build_model(model_cfg, dtype, getter, attention_backend=backend, seed=args.seed)
        forget_gguf_readers()  # weights and tokenizer are loaded: the file's reader is not needed again
        logger.info("loaded %s (%s, %s) in %.1f s", path, model_cfg.architecture, dtype, time.perf_counter() - t0)

        P = args.block_size or default_block_size(backend)
        M = cdiv(sched_cfg.max_model_len, P)
        max_useful = sched_cfg.max_num_seqs * M + 1
        if args.num_gpu_blocks_override is not None:
            num_blocks = args.num_gpu_blocks_override
        else:
            weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))
            num_blocks = num_blocks_for_memory(model_cfg, P, dtype, args.gpu_memory_utilization, weights,
                                               sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs,
                                               max_useful, kv_dtype=kv_dtype)
        self.cache_config = CacheConfig(block_size=P, num_blocks=num_blocks, dtype=kv_dtype)
        num_host_blocks = 0
        if args.preemption_mode != "recompute" and args.swap_space > 0:
            per_block = kv_bytes_per_block(model_cfg, P, kv_dtype)
            num_host_blocks = min(int(args.swap_space * 2**30 // per_block), 2 * max_useful)
        sched_cfg = dataclasses.replace(sched_cfg, num_host_blocks=num_host_blocks,
                                        swap_min_tokens=swap_min_tokens(model_cfg, kv_dtype, platform))
        self.scheduler_config = sched_cfg
        self.block_manager = BlockManager(num_blocks, P, enable_prefix_caching=args.enable_prefix_caching)
        self.scheduler = Scheduler(sched_cfg, self.block_manager, policy=args.scheduling_policy)
        self.penalty_capacity = table_capacity(sched_cfg.max_model_len, model_cfg.vocab_size)
        self.packer = BatchPacker(sched_cfg.max_num_batched_tokens, sched_cfg.max_num_seqs, M, P,
                                  self.penalty_capacity)
        self.runner = ModelRunner(model, model_cfg, self.cache_config, sched_cfg, args.max_logprobs,
                                  self.penalty_capacity)
        self.runner.warm_up()
        logger.info("KV pool: %d blocks of %d tokens (%d tokens), %s; swap pool: %d blocks", num_blocks - 1, P,
                    (num_blocks - 1) * P, kv_dtype, num_host_blocks)

        eos = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self._rng = np.random.default_rng(args.seed)
        self._states: dict[str, _RequestState] = {}
        self._groups: dict[str, _Group] = {}  # parent request id -> its samples
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType | Sequence[int]) -> tuple[list[int], str | None]:
        """A prompt as token ids (+ its text). Raises ValueError on an empty or malformed prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: pass at least one character or token id")
            return list(self.tokenizer.encode(prompt)), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)")
        elif isinstance(prompt, (list, tuple)):
            ids, text = prompt, None
        else:
            raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")  # noqa: TRY004 - vLLM's bad-input error
        V = self.model_config.vocab_size
        ids = list(ids)
        if not ids:
            raise ValueError("prompt_token_ids is empty: pass at least one token id")
        for t in ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < V:
                raise ValueError(f"prompt_token_ids must be integers in [0, {V}) (the vocab size), got {t!r}")
        return [int(t) for t in ids], text

    def make_request(self, request_id: str, prompt: PromptType | Sequence[int],
                     params: SamplingParams | None = None, arrival_time: float | None = None,
                     priority: int = 0) -> Request:
        """Validate and build a Request without adding it (so a batch can be checked up front)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 - bad input is a ValueError throughout the API
                f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be a 64-bit integer (lower runs first), got {priority!r}")
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"logprobs must be <= max_logprobs ({self.args.max_logprobs}), got {params.logprobs}")
        V = self.model_config.vocab_size
        for t in params.stop_token_ids:
            if t >= V:
                raise ValueError(f"stop_token_ids must be token ids in [0, {V}) (the vocab size), got {t}")
        if params.top_k > V:  # keeps every token, as top_k = 0 does (vLLM clamps it to the vocab too)
            params = dataclasses.replace(params, top_k=0)
        ids, text = self.tokenize_prompt(prompt)
        check_penalty_capacity(params, ids, self.eos_token_ids, self.scheduler_config.max_model_len,
                               self.model_config.vocab_size, self.penalty_capacity)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31 - 1))
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                      priority=priority, eos_token_ids=self.eos_token_ids, sample_seed=seed % (2**31 - 1),
                      prompt=text)
        self.scheduler.check_fits(req)
        return req

    def add_request(self, request_id: str, prompt: PromptType | Sequence[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        self.add_request_obj(self.make_request(request_id, prompt, params, arrival_time, priority))

    def add_request_obj(self, req: Request) -> None:
        """Queue a request made by make_request. With n > 1 its samples become sibling requests
        ("{i}_{request_id}", as vLLM names them) that share the prompt's KV blocks."""
        n = req.sampling_params.n
        rid = req.request_id
        if rid in self._groups or rid in self.scheduler.requests:
            raise ValueError(f"request_id {rid!r} is already in flight; use a unique id")
        if n == 1:
            self._add_one(req)
            return
        # With prefix caching off, the samples share blocks only among themselves.
        salt = req.cache_salt if self.args.enable_prefix_caching else int.from_bytes(
            hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
        children = [dataclasses.replace(req, request_id=f"{i}_{rid}", sample_seed=sample_seed(req.sample_seed, i),
                                        group_id=rid, group_size=n, output_token_ids=[], block_hashes=[],
                                        cache_salt=salt)
                    for i in range(n)]
        added: list[str] = []
        try:
            for child in children:
                self._add_one(child)
                added.append(child.request_id)
        except Exception:
            self.abort_request(added)  # all samples or none
            raise
        self._groups[rid] = _Group(req, children)

    def _add_one(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self._states[req.request_id] = _RequestState(
            req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        expanded = []
        for rid in ids:
            gid, members = self._group_of(rid)
            if gid is not None:
                del self._groups[gid]
            expanded.extend(members)
        self.scheduler.finish_requests(expanded, RequestStatus.FINISHED_ABORTED)
        for rid in expanded:
            self._states.pop(rid, None)

    def _group_of(self, rid: str) -> tuple[str | None, list[str]]:
        """(group id, its sample ids) when `rid` is an n > 1 request or one of its samples, else
        (None, [rid]): ending one sample ends them all."""
        state = self._states.get(rid)
        if state is not None and state.request.group_id in self._groups:
            rid = state.request.group_id
        group = self._groups.get(rid)
        return (rid, list(group.child_ids)) if group is not None else (None, [rid])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def get_stats(self) -> dict[str, float]:
        """Scheduler and KV-pool figures, named as vLLM's metrics (without the prefix)."""
        s = self.scheduler.stats()
        kv = self.block_manager.stats()
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "num_requests_swapped": s.num_swapped,
            "kv_cache_usage_perc": kv.usage,
            "num_preemptions": s.num_preemptions,
            "num_swap_outs": s.num_swap_outs,
            "num_block_copies": self.scheduler.num_block_copies,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": kv.prefix_hit_rate,
            "num_steps": s.num_steps,
            "num_scheduled_tokens": s.num_tokens,
            "num_padded_tokens": s.num_padding,
            "last_step_padded_tokens": s.last_padding,
        }

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        try:
            if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:  # even in an empty step
                self.runner.swap(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
            if out.is_empty:
                self.packer.penalties.forget(out.finished_ids)
                return []
            now = time.monotonic()
            for req in out.requests:
                if not req.first_scheduled_time:
                    req.first_scheduled_time = now
            batch = self.packer.pack(out, self.block_manager)
            res = self.runner.execute(batch)
        except Exception:
            self._recover_from_failed_step(out)
            raise
        failed = self._fail_requests(batch.rejected) if batch.rejected else []
        got = self.scheduler.update(out, res.sampled)
        return self._process(out, got, res) + failed

    def _fail_requests(self, reasons: dict[str, str]) -> list[RequestOutput]:
        """End requests whose rows the step could not take (FINISHED_ERROR, with the reason), and
        their sibling samples; they report now, the rest of the step goes on."""
        # A token id of theirs that did not fit was written as 0, so a block they registered in the
        # prefix cache may hold K/V of other tokens than its hash says: forget the cache (rare path).
        self.block_manager.reset_prefix_cache()
        outputs = []
        now = time.monotonic()
        for rid, why in reasons.items():
            if rid not in self._states:  # already ended with a sibling
                continue
            logger.error("request %s failed: %s", rid, why)
            gid, ids = self._group_of(rid)
            ids = [r for r in ids if r in self._states]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            done = {}
            for r in ids:
                st = self._states.pop(r)
                st.request.error, st.request.finished_time = why, now
                done[r] = self._output(st)
            if gid is None:
                outputs.extend(done.values())
            else:
                group = self._groups[gid]
                for r, o in done.items():
                    group.completions[group.child_ids.index(r)] = o.outputs[0]
                outputs.append(self._group_output(gid))
        return outputs

    def _recover_from_failed_step(self, out: SchedulerOutput) -> None:
        """After a step failed on the device, no block this step registered in the prefix cache
        and no host copy this step made can be trusted: forget the cache, and send requests
        swapped out this step back to waiting, to be recomputed. (The caller fails the requests
        the step ran.)"""
        sched = self.scheduler
        self.block_manager.reset_prefix_cache()
        for rid in out.swapped_out:
            req = sched.requests.get(rid)
            if req is not None and req.status == RequestStatus.SWAPPED:
                sched.swapped.remove(req)
                sched.swap_pool.release(rid)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                sched._insert(sched.waiting, req)

    def _process(self, out: SchedulerOutput, got: list[int], res: SamplerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        stopped = []
        for i in got:
            req = out.requests[i]
            state = self._states[req.request_id]
            token = req.output_token_ids[-1]
            if not req.first_token_time:
                req.first_token_time = now
            if state.logprobs is not None:
                state.logprobs.append(self._logprobs_entry(res, i, token, req.sampling_params.logprobs))
                state.cumulative_logprob += float(res.logprob[i])
            state.detok.add_token(token, last=req.is_finished)
            if state.detok.stop_string is not None and not req.is_finished:
                req.stop_reason = state.detok.stop_string
                stopped.append(req.request_id)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        groups: dict[str, None] = {}
        for i in got:
            req = out.requests[i]
            if req.is_finished:
                req.finished_time = now
                o = self._output(self._states.pop(req.request_id))
            else:
                o = self._output(self._states[req.request_id])
            if req.group_id is None:
                outputs.append(o)
            elif req.group_id in self._groups:
                group = self._groups[req.group_id]
                group.completions[group.child_ids.index(req.request_id)] = o.outputs[0]
                groups[req.group_id] = None
        for gid in groups:
            outputs.append(self._group_output(gid))
        return outputs

    def _group_output(self, gid: str) -> RequestOutput:
        group = self._groups[gid]
        parent = group.parent
        comps = []
        for i, c in enumerate(group.completions):
            if c is None:  # a sample with no token yet
                c = CompletionOutput(index=i, text="", token_ids=[])
            c.index = i
            comps.append(c)
        finished = all(c.finish_reason is not None for c in comps)
        if finished:
            del self._groups[gid]
        kids = group.children
        metrics = RequestMetrics(parent.arrival_time,
                                 min((c.first_scheduled_time for c in kids if c.first_scheduled_time), default=0.0),
                                 min((c.first_token_time for c in kids if c.first_token_time), default=0.0),
                                 max(c.finished_time for c in kids) if finished else 0.0,
                                 sum(c.num_preemptions for c in kids))
        return RequestOutput(gid, parent.prompt, parent.prompt_token_ids, comps, finished, metrics,
                             priority=parent.priority, error=next((c.error for c in kids if c.error), None))

    def _logprobs_entry(self, res: SamplerOutput, i: int, token: int, k: int) -> dict[int, Logprob]:
        dec = self.tokenizer.convert_ids_to_tokens
        entry = {token: Logprob(float(res.logprob[i]), int(res.rank[i]), dec(token))}
        for j in range(k):
            t = int(res.top_ids[i, j])
            if t not in entry:
                entry[t] = Logprob(float(res.top_logprobs[i, j]), j + 1, dec(t))
        return entry

    def _output(self, state: _RequestState) -> RequestOutput:
        req = state.request
        reason = req.finish_reason
        comp = CompletionOutput(
            index=0, text=state.detok.text, token_ids=list(req.output_token_ids),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            finish_reason=reason.value if reason else None, stop_reason=req.stop_reason)
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished, metrics,
                             priority=req.priority, error=req.error)

    def next_request_id(self) -> str:
        return str(next(self._ids))
