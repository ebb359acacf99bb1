"""What crosses between the front end and an engine core: msgspec structs, token ids only.

    front end --EngineCoreRequest / AbortRequests / UtilityRequest--> core
    front end <--EngineCoreOutputs (per request: new token ids, finish reason, logprob arrays)-- core

The core knows no text: tokenizing, detokenizing and stop strings are the front end's. In process
the structs are handed over as they are; across processes `encoder()` / `decoder()` write them as
msgpack (numpy arrays as raw bytes in a msgpack extension), so nothing is pickled on the way.
vLLM v1's EngineCoreRequest / EngineCoreOutputs are the anchor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np

from jaxsched.core.request import SamplingParams
from jaxsched.core.stats import EngineStats
from jaxsched.runner.memory_report import MemoryReport
from jaxsched.structured.params import StructuredOutputsParams

_ARRAY_EXT = 1  # the msgpack extension code of a numpy array


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True, gc=False):
    """One validated request: what the core needs to run it, nothing it would have to check again."""

    request_id: str
    prompt_token_ids: list[int]
    # a SamplingParams (a dict on the wire, turned back into one by __post_init__: the dataclass's
    # union fields are not msgspec types, and its checks run again where it is rebuilt)
    sampling_params: Any
    arrival_time: float  # time.monotonic() (one clock for every process of a host)
    priority: int = 0
    sample_seed: int = 0  # drawn by the front end, so a run replays whatever core runs it
    cache_salt: int = 0  # prefix caching: only requests of the same salt share blocks (0: none)
    # time.monotonic() after which the core ends the request ("timeout"), and after which it ends it
    # if it has not started ("queue_timeout"); None: never
    deadline: float | None = None
    queue_deadline: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sampling_params, dict):
            self.sampling_params = params_from_wire(self.sampling_params)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    """End requests (by a request's id or, for n > 1, a sample's: the whole group ends)."""

    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="call", array_like=True, gc=False):
    """Call one of EngineCore's utility methods (EngineCore.UTILITIES) between two steps; the
    result comes back in EngineCoreOutputs.utility. In process `method` may be any callable taking
    the core (a test's probe), which never crosses a process boundary."""

    call_id: int
    method: Any  # str, or in process a callable
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    """Stop the core's loop (a core process then exits)."""


CoreInput = EngineCoreRequest | AbortRequests | UtilityRequest | Shutdown


class LogprobArrays(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of a request's new tokens (n of them; k alternatives each, the request's logprobs)."""

    logprob: Any  # f32[n]    the sampled token's
    rank: Any  # i32[n]       the sampled token's rank (1: the most likely)
    top_ids: Any  # i32[n, k]
    top_logprobs: Any  # f32[n, k]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request (or one sample of an n > 1 request) got in a step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: LogprobArrays | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while it runs
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None  # why it failed (finish_reason "error")
    error_param: str | None = None  # the request field to blame, when its own input made it fail
    # set in its first output: when the core first scheduled it (time.monotonic())
    first_scheduled_time: float = 0.0
    num_preemptions: int = 0  # set in its final output
    # prompt_logprobs: the entries of prompt tokens prompt_logprobs_start.. (1 on: token 0 has none),
    # sent by the steps that computed them, before (or with) the first token
    prompt_logprobs: LogprobArrays | None = None
    prompt_logprobs_start: int = 0


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None  # the exception's "Type: message" when the call raised


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message from a core: a step's outputs, or a utility call's answer, with the core's stats."""

    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None  # the core's figures after the step
    utility: UtilityOutput | None = None
    engine_index: int = 0  # which core (data parallel)
    # a step failed on the device ("Type: message"): the requests whose KV it may have spoiled
    # ended (their outputs are in `outputs`, with error set); every other request is intact
    step_failure: str | None = None
    # the core ended every request in flight after a failure on the host, outside a step's device
    # work (their outputs are in `outputs`, with error set); it goes on with new requests
    failed_all: str | None = None


class CoreDead(msgspec.Struct, tag="dead", array_like=True, gc=False):
    """Posted by a client's watcher (never sent by a core): the core is gone, with why."""

    why: str


class CoreInfo(msgspec.Struct, array_like=True, gc=False):
    """What a core tells its client once it is ready (the front end sizes its checks from it)."""

    eos_token_ids: list[int]
    warmup_seconds: float
    kv_bytes_per_device: int
    memory: MemoryReport  # where one device's memory went (runner/memory_report.py)
    num_devices: int


def params_to_wire(sp: SamplingParams) -> dict[str, Any]:
    """SamplingParams as builtins, fields at their defaults left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        v = getattr(sp, f.name)
        if v != f.default:
            out[f.name] = v if f.name != "structured_outputs" else {
                g.name: getattr(v, g.name) for g in dataclasses.fields(StructuredOutputsParams)}
    return out


def params_from_wire(d: dict[str, Any]) -> SamplingParams:
    so = d.get("structured_outputs")
    if isinstance(so, dict):
        d = {**d, "structured_outputs": StructuredOutputsParams(**so)}
    return SamplingParams(**d)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        head = f"{obj.dtype.str}:{','.join(map(str, obj.shape))}:".encode()
        return msgspec.msgpack.Ext(_ARRAY_EXT, head + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, SamplingParams):
        return params_to_wire(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to or from an engine core")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _ARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    raw = bytes(data)
    dtype, shape, body = raw.split(b":", 2)
    dims = tuple(int(x) for x in shape.split(b",") if x)
    return np.frombuffer(body, np.dtype(dtype.decode())).reshape(dims)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput, ext_hook=_ext_hook)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs, ext_hook=_ext_hook)


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids an n > 1 request's samples run under in the core ("{i}_{id}", as vLLM names them)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request: distinct per sample, reproducible per seed."""
    return (seed + index * 0x9E3779B1) % (2**31 - 1)
