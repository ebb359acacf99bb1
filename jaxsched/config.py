"""Engine configuration: frozen dataclasses, validated once at construction, resolved once.

EngineArgs carries vLLM's argument names and meanings, and the only defaults. `resolve(args,
model, platform, ...)` turns it, once, into an EngineConfig: every "auto" and None decided (dtype,
attention backend, block size, KV dtype, pool and swap sizes, token budget, buckets), split into
the configs each subsystem reads: ModelConfig (the architecture), CacheConfig (the KV pool) and
SchedulerConfig (batching limits and buckets). Nothing downstream decides a setting again.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from jaxsched import platforms
from jaxsched.models.model_config import ModelConfig
from jaxsched.platforms.cpu_affinity import auto_async_scheduling
from jaxsched.sizing import DTYPE_BYTES

if TYPE_CHECKING:
    from jaxsched.core.policy import SchedulerPolicy
    from jaxsched.parallel.mesh import HeadLayout

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16")
_KV_DTYPES = ("auto", *DTYPE_BYTES)  # vLLM's names: "fp8" is e4m3
_PREEMPTION_MODES = ("recompute", "swap", "auto")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EngineArgs:
    """Arguments of `LLM(...)` / `LLMEngine(...)`, named as vLLM names them."""

    # a Hugging Face model folder, a .gguf file or a Hub id ("Qwen/Qwen3-0.6B", models/hub.py); None
    # means the demo model
    model: str | None = None
    tokenizer: str | None = None  # a folder or Hub id; defaults to the model's own tokenizer
    revision: str | None = None  # the Hub model's branch, tag or commit (default: main)
    tokenizer_revision: str | None = None  # the same for a Hub tokenizer given apart
    download_dir: str | None = None  # the Hugging Face cache to use (default: huggingface_hub's, HF_HUB_CACHE)
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # defaults to 2048 (or max_model_len without chunking)
    # tokens per KV block; None picks the attention backend's default_block_size, as vLLM picks
    # per platform: 16 for the Pallas kernel (a GPU), 128 for the CPU backends (as vLLM's CPU
    # backend), whose pages are cheaper to read in bigger pieces (docs/PERFORMANCE.md)
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20
    # dtype of the KV pool: "auto" = the model's dtype; "bfloat16" halves the pool's memory and
    # the bytes decode attention reads (at a small precision cost); with the CPU backends the pool
    # holds the bfloat16 bits as uint16, which XLA:CPU gathers fast (pallas_kernels/pool_storage.py)
    kv_cache_dtype: str = "auto"
    # weight-only quantization at load (jaxsched/models/quantize.py): "int8" or "fp8" (e4m3) keeps every
    # linear weight in 8 bits with a float32 scale per output channel, dequantized inside the
    # matmul; None keeps the weights in `dtype`. quantize_embedding: the embedding and lm_head too
    # (one scale per token), which a small model's vocabulary makes worth it and costs more quality
    quantization: str | None = None
    quantize_embedding: bool = False
    # "auto": the Pallas kernel on a GPU; on a CPU "numba" (attention in a numba kernel that reads KV
    # pages where they lie, called from the jitted step), or "xla" (the jnp path) where numba cannot
    # run; "pallas" on a CPU runs the kernel in interpret mode (slow; for tests)
    attention_backend: str = "auto"
    # how the model holds and runs its layers (jaxsched/models/layers.py): "stacked" (one scan over
    # weights with a leading layer axis), "per_layer" (a scan that switches between per-layer
    # weights), "unrolled" (per-layer weights, no loop); "auto" takes the platform's choice
    # (the platform record's layer_weights: jaxsched/platforms/platform.py)
    layer_weights: str = "auto"
    # how the sampler skips the parts a step does not need (jaxsched/runner/sampler.py): "device" (one
    # program per sequence bucket, with lax.conds), "host" (a few programs without conds, the host
    # picks one per step), "mixed" (the argmax alone for all-greedy steps without logprobs,
    # penalties, a logit_bias or a mask, the program with conds for the others); "auto" takes the
    # platform's choice (jaxsched/platforms/platform.py)
    sampler_branches: str = "auto"
    # how a request gives its KV blocks back when the pool runs dry: "recompute" drops them and
    # prefills again later; "swap" copies them to host memory; "auto" swaps when recomputing would
    # cost more than the copy (long contexts, n > 1)
    preemption_mode: str = "auto"
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    swap_threshold: float = 0.8  # above this KV usage no new request is admitted
    scheduling_policy: Any = "fcfs"  # "fcfs", "priority" or a jaxsched.core.policy.SchedulerPolicy instance
    enable_prefix_caching: bool = True
    max_num_queued_requests: int | None = None  # None: unbounded
    max_paddings: int = 32  # padded tokens per step the scheduler tries to stay within
    # largest prefill chunk one request gets per step while others wait for prefill; 0: no cap
    long_prefill_token_threshold: int = 0
    # devices one engine's model is split over (Megatron-style, on one mesh axis: parallel.py)
    tensor_parallel_size: int = 1
    # engine cores, each on its own tensor_parallel_size devices with its own step loop; a request goes
    # to the core that has its prompt's prefix cached, unless that one is overloaded, else to the
    # least loaded (core_client.DataParallelClient)
    data_parallel_size: int = 1
    # run each engine core (scheduler + model runner) in a process of its own, behind ZeroMQ, so its
    # step loop does not share a GIL with the front end (HTTP, tokenizing, detokenizing): see
    # core_process.py. None: in this process (LLM, LLMEngine), or for `jaxsched serve` the platform's
    # choice (serving/cli.py, measured in docs/PERFORMANCE.md)
    engine_core_process: bool | None = None
    # several hosts (jax.distributed): the coordinator's HOST:PORT, the process count and this
    # process's index; None everywhere: one host, or JAX's own detection under Slurm / MPI /
    # Kubernetes when distributed_coordinator is "auto"
    distributed_coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # overlapped scheduling: schedule and pack step N+1 while the device runs step N (engine.py);
    # None: on, except on a CPU where the host has no core of its own and the model keeps every core
    # busy (cpu_affinity.auto_async_scheduling, decided by the engine); False runs them in turns
    async_scheduling: bool | None = None
    # size each step by its predicted cost (a step-cost model fitted online from the engine's own
    # step times: step_cost.py): the most tokens per second, or with target_tpot_ms the largest
    # step predicted within that many milliseconds; None: on only with target_tpot_ms (on the
    # default offline run it measured slower than the max_paddings rule: docs/PERFORMANCE.md). With
    # speculative_config the model also sizes the proposals each step verifies, unless this is False
    # (then every proposal is verified)
    step_cost_model: bool | None = None
    target_tpot_ms: float | None = None
    # run every compiled program once at warm-up, on a batch of padding: a program's first run pays
    # one-time costs (on a CPU, XLA's fused kernels setting up), which otherwise
    # land on the first requests that use it (docs/PERFORMANCE.md, "Decisions in the code"). None:
    # on for `jaxsched serve`, where a burst of first requests would meet them, off for the library
    # (an offline run amortises them over its own steps and would wait longer to start)
    warm_up_runs: bool | None = None
    # on the CPU platform: cores kept for the host's Python threads (the engine loop, the server),
    # the model's threads (XLA's, numba's) on the others, as vLLM's CPU build reserves cores for
    # its front end (VLLM_CPU_NUM_OF_RESERVED_CPU). Pays for small models, whose steps are too short
    # for a second device thread to gain what the host's core costs (jaxsched/platforms/cpu_affinity.py);
    # 0: every thread on every core; "auto": one core where the model's work per token is small for
    # this machine's cores (cpu_affinity.auto_reserved_cores), else 0; None: "auto" for the
    # `jaxsched` commands, whose process is the engine's, 0 for the library (a reserve pins every
    # Python thread of the process to the host's cores: an imported engine does not do that unasked)
    cpu_reserved_cores: int | Literal["auto"] | None = None
    # speculative decoding, as vLLM spells it: a dict (or its JSON text, from the command line) with
    # "method" ("ngram": prompt lookup; "draft_model": a small model, "model" its path) and
    # "num_speculative_tokens", and for ngram "prompt_lookup_max" / "prompt_lookup_min"
    # (SpeculativeConfig); None: off
    speculative_config: str | dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size is not None and (
                not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % 8):
            raise ValueError(
                f"block_size must be a positive multiple of 8 (8, 16, 32, ...), got {self.block_size!r}; "
                "16 is the usual choice on a GPU, 128 on a CPU (None picks it)"
            )
        _check_positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                    f"({self.max_num_seqs}): every running sequence needs at least one token per step"
                )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2 (block 0 is reserved), got {self.num_gpu_blocks_override}"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        n = self.cpu_reserved_cores
        if n is not None and n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"cpu_reserved_cores must be a whole number >= 0 or 'auto', got {n!r}")
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_DTYPES}, got {self.kv_cache_dtype!r}")
        from jaxsched.models.quantize import QUANTIZATIONS

        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None (the weights in dtype), "
                             f"got {self.quantization!r}")
        if self.quantize_embedding and self.quantization is None:
            raise ValueError("quantize_embedding needs quantization ('int8' or 'fp8'): set both, or neither")
        if self.attention_backend != "auto":
            from pallas_kernels.backends import BACKENDS  # the registry of backend records

            if self.attention_backend not in BACKENDS:
                raise ValueError(f"attention_backend must be 'auto' or one of {tuple(BACKENDS)}, "
                                 f"got {self.attention_backend!r}")
        if self.layer_weights != "auto":
            from jaxsched.models.layers import LAYER_WEIGHTS

            if self.layer_weights not in LAYER_WEIGHTS:
                raise ValueError(f"layer_weights must be 'auto' or one of {LAYER_WEIGHTS}, got {self.layer_weights!r}")
        if self.sampler_branches != "auto":
            from pallas_kernels.tuning import SAMPLER_BRANCHES

            if self.sampler_branches not in SAMPLER_BRANCHES:
                raise ValueError(f"sampler_branches must be 'auto' or one of {SAMPLER_BRANCHES}, "
                                 f"got {self.sampler_branches!r}")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {_PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        if not 0.0 < self.swap_threshold <= 1.0:
            raise ValueError(f"swap_threshold must be in (0, 1], got {self.swap_threshold!r}")
        from jaxsched.core.policy import make_policy  # plain Python; raises saying what a policy must be

        make_policy(self.scheduling_policy)
        if self.max_num_queued_requests is not None:
            _check_positive("max_num_queued_requests", self.max_num_queued_requests)
        if not isinstance(self.max_paddings, int) or self.max_paddings < 0:
            raise ValueError(f"max_paddings must be a non-negative integer, got {self.max_paddings!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: no cap), got {self.long_prefill_token_threshold!r}"
            )
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("data_parallel_size", self.data_parallel_size)
        if self.num_processes is not None:
            _check_positive("num_processes", self.num_processes)
        if self.process_id is not None and (not isinstance(self.process_id, int) or self.process_id < 0):
            raise ValueError(f"process_id must be an integer >= 0, got {self.process_id!r}")
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ValueError(f"process_id ({self.process_id}) must be < num_processes ({self.num_processes})")
        if (self.num_processes or self.process_id is not None) and self.distributed_coordinator is None:
            raise ValueError("num_processes / process_id need distributed_coordinator (HOST:PORT of process 0, "
                             "or 'auto' for JAX's detection under Slurm / MPI / Kubernetes)")
        if self.distributed_coordinator == "auto" and (self.num_processes or self.process_id is not None):
            raise ValueError("distributed_coordinator='auto' lets JAX detect the process count and index (Slurm, "
                             "MPI, Kubernetes); drop num_processes / process_id, or give the coordinator's HOST:PORT")
        if self.distributed_coordinator not in (None, "auto"):
            host, _, port = self.distributed_coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"distributed_coordinator must be HOST:PORT (e.g. 10.0.0.1:1234) or 'auto', "
                                 f"got {self.distributed_coordinator!r}")
            if self.num_processes is None or self.process_id is None:
                raise ValueError("distributed_coordinator HOST:PORT needs num_processes and process_id too")
        if self.target_tpot_ms is not None:
            if not isinstance(self.target_tpot_ms, (int, float)) or not self.target_tpot_ms > 0:
                raise ValueError(f"target_tpot_ms must be a positive number of milliseconds, got {self.target_tpot_ms!r}")
            if self.step_cost_model is False:
                raise ValueError("target_tpot_ms needs the step-cost model (steps are sized by their predicted "
                                 "time): drop step_cost_model=False")
        if self.distributed_coordinator is not None and self.engine_core_process:
            raise ValueError("engine_core_process=True is not available with several hosts (each host's core runs "
                             "in its own process already); leave it unset")
        if self.distributed_coordinator is not None and self.speculative_config is not None:
            raise ValueError("speculative_config is not available with several hosts yet (the other hosts would "
                             "need the proposals' step times to size them alike); drop one of them")
        if self.distributed_coordinator is not None and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs on one host; across hosts, raise tensor_parallel_size "
                             "(one engine over every host's devices) or start one server per host")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments; an unknown name raises a TypeError that names it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(
                f"unknown engine argument(s): {', '.join(hints)}; valid arguments are {sorted(names)}"
            )
        return cls(**kwargs)


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 15  # a verified row is at most 16 positions


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (scheduler.py sizes the proposals, the step verifies them). method
    "ngram" (core/ngram.py): the tokens that followed the last occurrence in the request's own prompt
    and output of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min), up to
    num_speculative_tokens of them. method "draft_model": `model`, a smaller model with the target's
    vocabulary, run inside each step on the device with its own KV under the same block tables
    (model_runner.py), proposes them greedily. The step-cost model sizes each step's proposals (down
    to none)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: the draft's path (a folder, a GGUF file or a hub id)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            hint = (" (EAGLE heads are not built yet: use 'ngram' or 'draft_model')"
                    if self.method in ("eagle", "eagle3", "mtp") else "")
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.method!r}{hint}")
        for name, hi in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", 64),
                         ("prompt_lookup_min", 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {hi}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip() or len(self.model) > 4096:
                raise ValueError("speculative_config.model must name the draft model (a folder, a GGUF file or a hub "
                                 f"id, at most 4096 characters) for method 'draft_model', got {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model is for method 'draft_model' only; drop it for "
                             f"{self.method!r}")

    @property
    def width(self) -> int:
        """Q: the positions a verified row's logits are taken at (its proposals and one more)."""
        return self.num_speculative_tokens + 1

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """EngineArgs.speculative_config as given: None, a SpeculativeConfig, a dict or its JSON
        text. Unknown keys are refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be a JSON object, e.g. "
                                 f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}': {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}")  # noqa: TRY004 - every EngineArgs error is a ValueError
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {names}")
        if "method" not in value:
            raise ValueError("speculative_config needs a 'method' (one of "
                             f"{SPECULATIVE_METHODS})")
        return cls(**value)


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV block pool."""

    block_size: int  # P
    num_blocks: int  # NB, block 0 included (the null page)
    dtype: str
    max_blocks_per_seq: int  # M: blocks of a max_model_len sequence, the width of a block table

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. token_buckets / seq_buckets are every T and S a step may have. The
    defaults are EngineArgs' (tests build this directly; the engine gets it from resolve())."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    preemption_mode: str = EngineArgs.preemption_mode  # "recompute" | "swap" | "auto"
    # with "auto": swap a victim with at least this many computed tokens (recompute would cost more
    # than copying its blocks); resolve() derives it from the model's size (sizing.swap_min_tokens)
    swap_min_tokens: int = 1024
    num_host_blocks: int = 0  # the swap pool (swap_space); 0 disables swapping
    swap_threshold: float = EngineArgs.swap_threshold  # no new admissions above this KV usage
    max_paddings: int = EngineArgs.max_paddings
    long_prefill_token_threshold: int = EngineArgs.long_prefill_token_threshold  # 0: no cap
    max_num_queued_requests: int | None = EngineArgs.max_num_queued_requests  # the one owner of the limit
    speculative: SpeculativeConfig | None = None  # proposals per row, verified in the step; None: off


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine, decided: what resolve() returns and the engine builds from."""

    model_path: str
    tokenizer_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: str  # of the activations, and of the weights not quantized
    attention_backend: str  # a name in pallas_kernels.backends.BACKENDS, never "auto"
    penalty_capacity: int  # W of the penalty tables (penalties.table_capacity)
    max_logprobs: int
    seed: int
    enable_prefix_caching: bool
    scheduling_policy: SchedulerPolicy
    # the checkpoint's architecture; `model` above has the head counts it runs with (heads.apply)
    checkpoint_model: ModelConfig
    tensor_parallel_size: int
    heads: HeadLayout  # how the heads are laid out over the tensor_parallel_size devices
    layer_weights: str  # models/layers.py's layout, never "auto" (the platform record decides "auto")
    sampler_branches: str = "device"  # "device", "host" or "mixed" (the platform record decides "auto")
    async_scheduling: bool = True  # overlapped scheduling (engine.py)
    step_cost_model: bool = False  # steps sized by predicted cost (scheduler.py, step_cost.py)
    target_tpot_ms: float | None = None
    warm_up_runs: bool = False  # every program run once at warm-up (runner.warm_up)
    cpu_reserved_cores: int = 0  # cores for the host's Python threads (cpu_affinity.py); CPU only
    quantization: str | None = None  # weight-only, at load (models/quantize.py)
    quantize_embedding: bool = False
    # speculative decoding sizes its proposals by the step-cost model (speculation.py); False: every
    # proposal is verified (step_cost_model=False)
    speculation_by_cost: bool = True
    # speculative_config's draft_model: the draft's config as it runs (its KV pool has the target's
    # blocks, in its own shapes: model_runner.py); None without one
    draft_model: ModelConfig | None = None


def quantization_of(args: EngineArgs, model: ModelConfig) -> str | None:
    """The weights' quantization: --quantization, else a pre-quantized checkpoint's own kind (kept
    in 8 bits on the device, as vLLM keeps an FP8 checkpoint)."""
    return args.quantization or model.quantized_checkpoint


def token_budget(args: EngineArgs, max_len: int) -> int:
    """max_num_batched_tokens as resolve() decides it, for a max_model_len of max_len."""
    if args.enable_chunked_prefill:
        return args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    return args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_len, args.max_num_seqs)


def reserved_cores(n: int | str | None, platform: str, counted: int | None = None) -> int:
    """EngineArgs.cpu_reserved_cores, checked against the platform and this process's cores. "auto"
    is counted before jax starts (engine/core.reserve_count) and comes in as `counted`; it is 0 where
    the model does not run on the host's cores after all. None is 0."""
    if n == "auto":
        if counted is None:
            raise ValueError("cpu_reserved_cores='auto' is counted before jax starts (engine/core.reserve_count); "
                             "resolve() takes that count as reserved=")
        if counted and not platforms.of(platform).host_runs_model:
            logger.info("cpu_reserved_cores=auto: 0 after all (jax runs the model on %s, not the host's cores)",
                        platform)
            return 0
        n = counted
    if not n:
        return 0
    if not platforms.of(platform).host_runs_model:
        raise ValueError(f"cpu_reserved_cores={n} applies to the CPU platform only (on {platform} the model does not "
                         "run on the host's cores); leave it at 0 here")
    from jaxsched.platforms.cpu_affinity import check

    check(n)
    return n


def decide_async_scheduling(args: EngineArgs, model: ModelConfig, platform: str, reserved: int) -> bool:
    """EngineArgs.async_scheduling, None decided by the platform's rule (logged with why). With
    speculative decoding None is off: a row's proposals come from its tokens so far, which the host
    must have read, so the overlap pauses before every step that may verify proposals
    (scheduler.may_propose) and gains only where proposals are turned down (docs/PERFORMANCE.md,
    "Speculative decoding, demo model"); True keeps it for the other steps."""
    if args.speculative_config is not None and args.async_scheduling is None:
        return False
    if args.async_scheduling is not None:
        return args.async_scheduling
    host = platforms.of(platform).host_runs_model
    on, why = auto_async_scheduling(model, cpu=host, reserved=reserved,
                                    multi_host=args.distributed_coordinator is not None)
    (logger.info if host else logger.debug)("async_scheduling: %s (%s)", "on" if on else "off", why)
    return on


def resolve(args: EngineArgs, model: ModelConfig, model_path: str, platform: str,
            weights_bytes: Callable[[ModelConfig, str], int], memory: Callable[[], tuple[int, int]],
            reserved: int | None = None, draft: ModelConfig | None = None) -> EngineConfig:
    """Decide every "auto" and None of `args` for `model` on `platform` ("cpu" / "gpu"), once.

    weights_bytes(model, dtype) is the weights' size per device for the (run) model config in
    that dtype; memory() one device's (total, free) bytes (asked only when the pool is sized from
    memory). reserved: cpu_reserved_cores="auto" as counted before jax started. Raises ValueError
    saying what to change.
    """
    from jaxsched.core.buckets import seq_buckets, token_buckets
    from jaxsched.core.kv_groups import kv_groups
    from jaxsched.core.policy import make_policy
    from jaxsched.parallel.mesh import head_layout
    from jaxsched.runner.penalties import table_capacity
    from jaxsched.sizing import kv_bytes_per_block, num_blocks_for_memory, swap_min_tokens
    from pallas_kernels.backends import choose

    plat = platforms.of(platform)
    n_reserved = reserved_cores(args.cpu_reserved_cores, platform, reserved)
    dtype = args.dtype
    if dtype == "auto":
        # the platform's dtype (a CPU's float32, a GPU's bfloat16), else the checkpoint's: 16-bit
        # ones in bfloat16 (float32's range), float32 ones as they are
        dtype = plat.dtype or ("float32" if model.dtype in ("float32", "float64") else "bfloat16")
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    tp = args.tensor_parallel_size
    max_len = args.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_len}) is larger than the model's max_position_embeddings "
            f"({model.max_position_embeddings}); lower max_model_len"
        )
    model = without_idle_window(model, max_len)
    checkpoint, heads = model, head_layout(model, tp)
    model = heads.apply(checkpoint)  # from here on: the heads as they run, K / tp of them per device
    backend, skipped = choose(args.attention_backend, platform, model.head_dim, args.block_size, dtype, kv_dtype, tp,
                              model.attn_softcap is not None)
    for why in skipped:
        logger.warning("attention_backend auto: %s", why)
    P = args.block_size or backend.default_block_size
    if draft is not None:
        draft = check_draft(draft, model, max_len, backend.name, platform, P, dtype, kv_dtype, tp)

    budget = token_budget(args, max_len)
    if not args.enable_chunked_prefill and budget < max_len:
        raise ValueError(
            f"with enable_chunked_prefill=False, max_num_batched_tokens ({budget}) must be >= "
            f"max_model_len ({max_len}) so that any prompt fits in one step"
        )
    max_seqs = min(args.max_num_seqs, budget)

    M = -(-max_len // P)
    # every sequence at full length in every layer group (core/kv_groups.py), plus the null page
    max_useful = max_seqs * M * kv_groups(model).num_groups + 1
    # a draft model's weights and its KV (the same blocks, its own layers and heads) share the memory
    draft_weights = weights_bytes(draft, dtype) if draft is not None else 0
    draft_block = kv_bytes_per_block(draft, P, kv_dtype) if draft is not None else 0
    num_blocks = args.num_gpu_blocks_override or num_blocks_for_memory(
        model, P, dtype, kv_dtype, args.gpu_memory_utilization, memory(), weights_bytes(model, dtype) + draft_weights,
        budget, max_seqs, max_useful, tp, extra_block_bytes=draft_block)
    num_host_blocks = 0
    preemption_mode = args.preemption_mode
    if args.distributed_coordinator is not None:
        # several hosts: each would swap only its own shards, which is not implemented; recompute
        if preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' is not available with several hosts (each host would swap "
                             "only its own shards, which is not implemented); use 'recompute' or 'auto'")
        preemption_mode = "recompute"
    # the swap pool is host memory of this process, holding every shard (one host)
    elif args.preemption_mode != "recompute" and args.swap_space > 0:
        num_host_blocks = min(int(args.swap_space * 2**30 // (kv_bytes_per_block(model, P, kv_dtype) + draft_block)),
                              2 * max_useful)
    sched = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
        enable_chunked_prefill=args.enable_chunked_prefill, token_buckets=token_buckets(budget, max_seqs),
        seq_buckets=seq_buckets(max_seqs), preemption_mode=preemption_mode,
        swap_min_tokens=swap_min_tokens(model, kv_dtype, plat), num_host_blocks=num_host_blocks,
        swap_threshold=args.swap_threshold, max_paddings=args.max_paddings,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_queued_requests=args.max_num_queued_requests, speculative=args.speculative_config)
    return EngineConfig(
        model_path=model_path, tokenizer_path=args.tokenizer or model_path, model=model,
        cache=CacheConfig(block_size=P, num_blocks=num_blocks, dtype=kv_dtype, max_blocks_per_seq=M), scheduler=sched,
        dtype=dtype,
        attention_backend=backend.name, penalty_capacity=table_capacity(max_len, model.vocab_size),
        max_logprobs=args.max_logprobs, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=make_policy(args.scheduling_policy), checkpoint_model=checkpoint, tensor_parallel_size=tp,
        heads=heads, async_scheduling=decide_async_scheduling(args, checkpoint, platform, n_reserved),
        step_cost_model=args.step_cost_model if args.step_cost_model is not None else args.target_tpot_ms is not None,
        target_tpot_ms=args.target_tpot_ms, warm_up_runs=bool(args.warm_up_runs),
        cpu_reserved_cores=n_reserved, quantization=quantization_of(args, checkpoint),
        quantize_embedding=args.quantize_embedding, speculation_by_cost=args.step_cost_model is not False,
        layer_weights=plat.layer_weights if args.layer_weights == "auto" else args.layer_weights,
        sampler_branches=plat.sampler_branches if args.sampler_branches == "auto" else args.sampler_branches,
        draft_model=draft)


def without_idle_window(cfg: ModelConfig, max_len: int) -> ModelConfig:
    """A window no shorter than the context changes nothing: the model runs without its masks."""
    if cfg.sliding_window is not None and max_len <= cfg.sliding_window:
        return dataclasses.replace(cfg, sliding_window=None)
    return cfg


def check_draft(draft: ModelConfig, model: ModelConfig, max_len: int, backend: str, platform: str, P: int,
                dtype: str, kv_dtype: str, tp: int) -> ModelConfig:
    """speculative_config's draft model, checked against the target it proposes for: the same
    vocabulary size (the tokenizers themselves are compared where they are loaded: engine/core.py),
    room for max_model_len, one layer group each (its KV shares the target's block tables, whose
    pages a sliding window would free), one device, and the target's attention backend. Returns
    the draft's config as it runs. Raises ValueError naming the field."""
    from jaxsched.core.kv_groups import kv_groups
    from pallas_kernels.backends import choose

    where = "speculative_config.model"
    if draft.vocab_size != model.vocab_size:
        raise ValueError(f"{where}: the draft's vocabulary has {draft.vocab_size} tokens and the target's "
                         f"{model.vocab_size}; a draft must share the target's tokenizer and vocabulary (pick a "
                         "smaller model of the same family)")
    if tp > 1:
        raise ValueError(f"{where}: a draft model with tensor_parallel_size > 1 is not built yet; use "
                         "tensor_parallel_size=1 or method 'ngram'")
    if max_len > draft.max_position_embeddings:
        raise ValueError(f"{where}: the draft's max_position_embeddings ({draft.max_position_embeddings}) is shorter "
                         f"than max_model_len ({max_len}); lower max_model_len or pick a draft with a longer context")
    draft = without_idle_window(draft, max_len)
    for name, cfg in (("the target", model), ("the draft", draft)):
        if kv_groups(cfg).num_groups > 1:
            raise ValueError(f"{where}: {name} has sliding-window layers beside full-attention ones, whose pages the "
                             "shared block tables free apart; a draft model does not support that yet: use method "
                             "'ngram', or a max_model_len no longer than the window")
    try:
        choose(backend, platform, draft.head_dim, P, dtype, kv_dtype, 1, draft.attn_softcap is not None)
    except ValueError as e:
        raise ValueError(f"{where}: the draft cannot run on the target's attention backend {backend!r}: {e}") from None
    return draft
