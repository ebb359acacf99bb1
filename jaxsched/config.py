"""Engine configuration: frozen dataclasses, validated once at construction.

EngineArgs carries vLLM's argument names and meanings. The engine resolves it into three
smaller configs that each subsystem reads: ModelConfig (the architecture), CacheConfig (the KV
pool) and SchedulerConfig (batching limits and buckets).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16")
_ATTENTION_BACKENDS = ("auto", "pallas", "numba", "xla")
_PREEMPTION_MODES = ("recompute", "swap", "auto")


def default_block_size(attention_backend: str) -> int:
    """Tokens per KV block when EngineArgs.block_size is None (see its comment)."""
    return 16 if attention_backend == "pallas" else 128


@dataclass(frozen=True)
class EngineArgs:
    """Arguments of `LLM(...)` / `LLMEngine(...)`, named as vLLM names them."""

    model: str | None = None  # HF folder or .gguf file; None means the demo model
    tokenizer: str | None = None  # defaults to the model's own tokenizer
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # defaults to 2048 (or max_model_len without chunking)
    # tokens per KV block; None picks per attention backend, as vLLM picks per platform: 16 for
    # the Pallas kernel (a GPU), 128 for the XLA path (a CPU; vLLM's CPU backend also uses 128),
    # whose gathers copy a page per index: decode attention 12.8 -> 8.8 ms/layer going from 16 to
    # 128 (docs/PERFORMANCE.md)
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20
    # dtype of the KV pool: "auto" = the model's dtype; "bfloat16" halves the pool's memory and
    # the bytes decode attention reads (at a small precision cost); with the CPU backends the pool
    # holds the bfloat16 bits as uint16, which XLA:CPU gathers fast (pallas_kernels/kv_cache.py)
    kv_cache_dtype: str = "auto"
    # "auto": the Pallas kernel on a GPU; on a CPU "numba" (attention in a numba kernel that reads KV
    # pages where they lie, called from the jitted step), or "xla" (the jnp path) where numba cannot
    # run; "pallas" on a CPU runs the kernel in interpret mode (slow; for tests)
    attention_backend: str = "auto"
    # how a request gives its KV blocks back when the pool runs dry: "recompute" drops them and
    # prefills again later; "swap" copies them to host memory; "auto" swaps when recomputing would
    # cost more than the copy (long contexts, n > 1)
    preemption_mode: str = "auto"
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    swap_threshold: float = 0.8  # above this KV usage no new request is admitted
    # "fcfs", "priority", or a SchedulerPolicy instance (see jaxsched/policy.py)
    scheduling_policy: Any = "fcfs"
    enable_prefix_caching: bool = True
    max_num_queued_requests: int | None = None  # None: unbounded
    max_paddings: int = 32  # padded tokens per step the scheduler tries to stay within
    # largest prefill chunk one request gets per step while others wait for prefill; 0: no cap
    long_prefill_token_threshold: int = 0
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
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
        if self.kv_cache_dtype not in _DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {_PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        if not 0.0 < self.swap_threshold <= 1.0:
            raise ValueError(f"swap_threshold must be in (0, 1], got {self.swap_threshold!r}")
        if isinstance(self.scheduling_policy, str) and self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs', 'priority' or a SchedulerPolicy instance, got "
                f"{self.scheduling_policy!r}"
            )
        if self.max_num_queued_requests is not None:
            _check_positive("max_num_queued_requests", self.max_num_queued_requests)
        if not isinstance(self.max_paddings, int) or self.max_paddings < 0:
            raise ValueError(f"max_paddings must be a non-negative integer, got {self.max_paddings!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: no cap), got {self.long_prefill_token_threshold!r}"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size must be 1 (this release runs on one device), got {self.tensor_parallel_size!r}"
            )

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


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's architecture, read from a Hugging Face config.json (or GGUF metadata)."""

    architecture: str  # HF name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # HF's rope_scaling dict as sorted items (hashable)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral / Qwen2 option; only allowed when >= max_model_len
    dtype: str = "float32"  # the checkpoint's dtype

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The KV block pool."""

    block_size: int  # P
    num_blocks: int  # NB, block 0 included (the null page)
    dtype: str

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. token_buckets / seq_buckets are every T and S a step may have."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    preemption_mode: str = "recompute"  # "recompute" | "swap" | "auto"
    # with "auto": swap a victim with at least this many computed tokens (recompute would cost more
    # than copying its blocks); the engine derives it from the model's size
    swap_min_tokens: int = 1024
    num_host_blocks: int = 0  # the swap pool (swap_space); 0 disables swapping
    swap_threshold: float = 1.0  # no new admissions above this KV usage
    max_paddings: int = 32
    long_prefill_token_threshold: int = 0  # 0: no cap
    max_num_queued_requests: int | None = None
