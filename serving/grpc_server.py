"""The gRPC front end (jaxsched/proto/jaxsched.proto), beside the HTTP server on its AsyncEngine.

    jaxsched serve --grpc-port 50051    # HTTP on --port, gRPC on 50051: one engine, one step loop

It runs on the HTTP server's event loop (started and stopped with it, serving/server.py), so both
front ends share the engine thread, its admission limit (max_num_queued_requests) and its metrics.
A Generate request is turned into the HTTP route's CompletionRequest and goes through the same
code (app._Server.completion_inputs): the same fields, defaults and checks, and errors that name the
field as the client spelled it ("sampling_params.top_k"). Token ids go out as they come from the
engine; text deltas only when asked (return_text).

Status codes: INVALID_ARGUMENT for a bad field (or a grammar the parser could not follow once
generation started) or a request that does not decode as its message type, RESOURCE_EXHAUSTED for
a full queue (and, from grpcio itself, a message over --max-request-bytes), UNAVAILABLE once the
engine is stopping, UNAUTHENTICATED without the --api-key (`authorization: Bearer KEY` metadata;
the health service stays open, as /health does), INTERNAL when a step failed on the device with the
request in it. Every error carries trailing metadata `param` (the field) and `code` (the HTTP
route's error code) where known.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import jaxsched
from jaxsched.engine.outputs import CompletionOutput, Logprob, RequestOutput
from jaxsched.proto import jaxsched_pb2 as pb
from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc
from serving.app import engine_failure
from serving.async_engine import (
    EngineDeadError,
    EngineStepError,
    QueueTimeoutError,
    RequestStream,
    merge_delta,
)
from serving.protocol import CompletionRequest, RequestError

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxsched.v1.Generation"
# GenerateRequest's own fields with an HTTP namesake; the other HTTP fields are sampling_params.*
_TOP_LEVEL = ("prompt", "text", "token_ids", "priority", "truncate_prompt_tokens", "request_id", "cache_salt",
              "add_special_tokens", "stream", "stream_interval")
# A status message is sent as a trailer, UTF-8 and then percent-encoded (a byte outside printable
# ASCII becomes 3), and a client refuses metadata past 8-16 KiB (grpcio's soft and hard limits):
# longer messages are cut to this many UTF-8 bytes.
MAX_MESSAGE_BYTES = 1500
MAX_STREAMS_PER_CONNECTION = 256  # calls one connection may have open at once


def trailer_safe(message: str) -> str:
    raw = message.encode()
    if len(raw) <= MAX_MESSAGE_BYTES:
        return message
    return raw[:MAX_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """The client's address without its port ("ipv4:1.2.3.4:5678" -> "ipv4:1.2.3.4"), for fairness."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


def _status(err: RequestError) -> grpc.StatusCode:
    if err.status == 503:
        return grpc.StatusCode.RESOURCE_EXHAUSTED if err.code == "server_overloaded" else grpc.StatusCode.UNAVAILABLE
    return {401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
            413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}.get(
        err.status, grpc.StatusCode.INTERNAL if err.status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)


def _fields(msg: Any) -> dict[str, Any]:
    """The fields a message has set, as JSON-like builtins (unset optional fields are absent)."""
    out: dict[str, Any] = {}
    for field, value in msg.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.message_type is not None:
            out[field.name] = ([_fields(v) for v in value]
                               if field.is_repeated else _fields(value))
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def completion_request(request: pb.GenerateRequest) -> tuple[CompletionRequest, str]:
    """The HTTP route's request for a Generate call, and the name of the prompt's field."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise RequestError("the request has no prompt: set text or token_ids", param="prompt")
    if which == "token_ids" and not request.token_ids.ids:
        raise RequestError("token_ids is empty: pass at least one token", param="token_ids")
    if request.stream not in pb.StreamMode.values():
        raise RequestError(f"stream is {request.stream}, not a StreamMode: STREAM_MODE_TOKENS (0) or "
                           "STREAM_MODE_FINAL (1)", param="stream")
    if request.stream_interval < 0:
        raise RequestError(f"stream_interval must be >= 0 tokens (0 or 1: every step's), got "
                           f"{request.stream_interval}", param="stream_interval")
    sampling = _fields(request.sampling_params)
    if "logit_bias" in sampling:  # JSON's keys are strings, as the HTTP route takes them
        sampling["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
    so = sampling.get("structured_outputs")
    if so is not None and "choice" in so:
        so["choice"] = so["choice"].get("choices", [])
    body = {**sampling, "prompt": request.text if which == "text" else list(request.token_ids.ids),
            "max_tokens": sampling.get("max_tokens"),  # unset: up to max_model_len in all, not 16
            "priority": request.priority, "request_id": request.request_id or None,
            "cache_salt": request.cache_salt or None,
            # the engine's outputs: deltas to stream, or the final one (STREAM_MODE_FINAL)
            "stream": request.stream != pb.STREAM_MODE_FINAL}
    for name in ("add_special_tokens", "truncate_prompt_tokens"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    try:
        return msgspec.convert(body, CompletionRequest), which
    except msgspec.ValidationError as e:  # proto types are narrower than JSON's: a bug, not the client's
        raise RequestError(f"invalid request: {e}") from e


class _Stream:
    """One Generate call's outputs (DELTA, or with STREAM_MODE_FINAL the one final output) to
    GenerateResponses: a sample's new tokens wait until stream_interval of them have come."""

    def __init__(self, request_id: str, request: pb.GenerateRequest, top: int | None, n: int,
                 prompt_tokens: int) -> None:
        self.request_id = request_id
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.final_only = request.stream == pb.STREAM_MODE_FINAL
        self.interval = 1 if self.final_only else max(1, request.stream_interval)
        self.return_text = request.return_text
        self.top = top  # logprobs asked for (None: none)
        self.prompt_top = request.sampling_params.prompt_logprobs \
            if request.sampling_params.HasField("prompt_logprobs") else None
        self.prompt_logprobs: list | None = None  # the prompt's entries, until a message carries them
        self.waiting: dict[int, CompletionOutput] = {}  # sample index -> its tokens not sent yet
        self.tokens = 0  # tokens of every sample so far
        self.done: set[int] = set()  # samples whose finish_reason is sent

    def message(self, out: RequestOutput) -> pb.GenerateResponse | None:
        if out.prompt_logprobs is not None and self.prompt_top is not None:
            ids = out.prompt_token_ids
            self.prompt_logprobs = [_logprob(ids[t], e, self.prompt_top) for t, e in enumerate(out.prompt_logprobs)
                                    if e is not None]
        outputs = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if c.index in self.done:  # its last message is sent
                continue
            self.tokens += len(c.token_ids)
            w = self.waiting.get(c.index)
            if w is None:
                w = self.waiting[c.index] = c
            else:
                merge_delta(RequestOutput("", None, [], [w], False), RequestOutput("", None, [], [c], False))
            if w.finish_reason is None and len(w.token_ids) < self.interval:
                continue
            del self.waiting[c.index]
            outputs.append(self._output(w))
            if w.finish_reason is not None:
                self.done.add(c.index)
        if out.finished:  # a request aborted before its first step has no outputs: each sample still ends
            outputs += [pb.Output(index=i, finish_reason="abort") for i in range(self.n) if i not in self.done]
        if not outputs and not out.finished:
            return None
        msg = pb.GenerateResponse(request_id=self.request_id, outputs=outputs, finished=out.finished)
        if self.prompt_logprobs:
            msg.prompt_logprobs.extend(self.prompt_logprobs)
            self.prompt_logprobs = []
        if out.finished:
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.tokens,
                                        total_tokens=self.prompt_tokens + self.tokens))
        return msg

    def _output(self, d: CompletionOutput) -> pb.Output:
        o = pb.Output(index=d.index, token_ids=d.token_ids, text=d.text if self.return_text else "",
                      finish_reason=d.finish_reason or "")
        if self.top is not None and d.logprobs:
            o.logprobs.extend(_logprob(t, entry, self.top) for t, entry in zip(d.token_ids, d.logprobs))
        if isinstance(d.stop_reason, str):
            o.stop_str = d.stop_reason
        elif isinstance(d.stop_reason, int):
            o.stop_token_id = d.stop_reason
        return o


def _logprob(token_id: int, entry: dict[int, Logprob], top: int) -> pb.TokenLogprob:
    ranked = sorted((lp.rank, k, lp.logprob) for k, lp in entry.items() if lp.rank is not None and lp.rank <= top)
    chosen = entry.get(token_id)
    return pb.TokenLogprob(token_id=token_id, logprob=chosen.logprob if chosen else float("nan"),
                           top=[pb.TopLogprob(token_id=k, logprob=v, rank=r) for r, k, v in ranked])


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, server: Any) -> None:
        self.server = server  # app._Server: the HTTP routes' checks, converter and engine
        self.live: dict[str, RequestStream] = {}  # Generate calls in flight, by request_id
        # Generate calls with a request_id, still being checked / admitted; Abort marks them in
        # `aborted`, and they are aborted as soon as the engine has them
        self.admitting: dict[str, int] = {}
        self.aborted: set[str] = set()

    async def _fail(self, context: grpc.aio.ServicerContext, err: RequestError, prompt_field: str | None = None
                    ) -> None:
        """End the call with err's status; a Generate call's (prompt_field given) names the field
        as GenerateRequest spells it."""
        param = err.param
        if prompt_field is not None and param == "prompt":
            param = prompt_field
        elif prompt_field is not None and param is not None and param.split(".", 1)[0] not in _TOP_LEVEL:
            param = f"sampling_params.{param}"
        message = trailer_safe(err.message if param is None else f"{param}: {err.message}")
        context.set_trailing_metadata(tuple((k, v) for k, v in (("param", param), ("code", err.code)) if v))
        await context.abort(_status(err), message)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        s = self.server
        prompt_field = "prompt"  # the oneof, until we know which of its fields came
        rid = request.request_id or uuid.uuid4().hex
        self.admitting[rid] = self.admitting.get(rid, 0) + 1
        abort_now = False
        failed: RequestError | None = None
        try:
            req, prompt_field = completion_request(request)
            prompts, params = await s.completion_inputs(req, _peer_host(context))  # one prompt: text or token ids
            stream, = await s.add_requests([rid], [prompts[0][0]], [prompts[0][1]], params, req.priority,
                                           req.cache_salt, prompt_field)
        except RequestError as e:
            failed = e
        finally:
            self.admitting[rid] -= 1
            if not self.admitting[rid]:
                del self.admitting[rid]
                abort_now = rid in self.aborted  # Abort came while it was being admitted
                self.aborted.discard(rid)
        if failed is not None:
            # (a duplicate of a call admitted meanwhile: the Abort meant for that one is carried out)
            if abort_now and rid in self.live:
                await s.engine.abort(rid)
            await self._fail(context, failed, prompt_field)
            return
        try:
            self.live[rid] = stream
            if abort_now:
                await s.engine.abort(rid)
            sp = params[0]
            conv = _Stream(rid, request, sp.logprobs, sp.n, len(prompts[0][0]))
            async for out in stream:
                msg = conv.message(out)
                if msg is not None:
                    yield msg
        except (EngineDeadError, EngineStepError) as e:  # shut down, or this request failed alone
            await self._fail(context, engine_failure(e), prompt_field)
        except QueueTimeoutError as e:  # waited past --queue-timeout without starting: UNAVAILABLE, retryable
            await self._fail(context, RequestError(str(e), status=503, code="queue_timeout"))
        finally:  # also when the client cancels: closing an unfinished stream aborts its request
            if self.live.get(rid) is stream:
                del self.live[rid]
            stream.close()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        if rid in self.live:  # its Generate stream ends with finish_reason "abort"
            await self.server.engine.abort(rid)
            return pb.AbortResponse(found=True)
        if rid in self.admitting:
            self.aborted.add(rid)
            return pb.AbortResponse(found=True)
        return pb.AbortResponse(found=False)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:  # counting tokens is this call's purpose: a text longer than max_model_len is tokenized too
            ids = await self.server.conv.tokenize(request.text, param="text", add_special_tokens=add, limit=False)
        except RequestError as e:
            await self._fail(context, e)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=self.server.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> pb.DetokenizeResponse:
        try:
            return pb.DetokenizeResponse(text=await self.server.conv.detokenize(list(request.token_ids), "token_ids"))
        except RequestError as e:
            await self._fail(context, e)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        s = self.server
        llm = s.engine.engine
        return pb.ModelInfo(served_model_name=s.name, model_path=str(s.root), max_model_len=s.max_model_len,
                            vocab_size=s.conv.vocab_size, eos_token_ids=list(llm.eos_token_ids),
                            max_logprobs=s.conv.max_logprobs, scheduling_policy=s.policy,
                            max_num_seqs=llm.scheduler_config.max_num_seqs, version=jaxsched.__version__)


class HealthService(health.aio.HealthServicer):
    """grpc.health.v1: SERVING while the engine runs, for the server ("") and for Generation."""

    MAX_WATCHERS = 64  # Watch streams open at once; each holds a task and a stream of the server's

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine
        self._watching = 0

    async def _refresh(self) -> None:
        up = self.engine.is_running and self.engine.stalled() is None
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            await self.set(service, status)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        await self._refresh()
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if self._watching >= self.MAX_WATCHERS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self._watching} Health.Watch streams are open, the server's limit: close one, or "
                                "poll with Check")
        self._watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watching -= 1


class _Malformed:
    """What a request that is not a valid message of its type decodes to (the servicer never sees it)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _WellFormed(grpc.aio.ServerInterceptor):
    """A request the method's message type cannot decode (corrupt wire format, a string field that
    is not UTF-8) ends with INVALID_ARGUMENT saying so. Without this, grpcio's own handling of a
    failed decode answers UNKNOWN and logs an error."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/") or handler.request_streaming:
            return handler  # (the health service is grpcio's, and takes no request fields)
        decode = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or a UTF-8 error
                return _Malformed(e)

        def refuse(request: _Malformed) -> str:
            return (f"the request is not a valid {details.method.rsplit('/', 1)[-1]} request message "
                    f"({request.error}): send a message of the method's type")

        kw = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
        if handler.unary_stream is not None:
            inner = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refuse(request))
                async for msg in inner(request, context):
                    yield msg

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        inner_unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refuse(request))
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


class _ApiKey(grpc.aio.ServerInterceptor):
    """`authorization: Bearer KEY` on every call but the health service's (as /health over HTTP)."""

    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self.expected):
            return handler
        message = (f"{'missing' if not got else 'invalid'} API key: send the metadata "
                   "'authorization: Bearer <key>' with the server's --api-key")

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # an async generator, as a server-streaming handler is

        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(deny, **kw)


class GrpcFrontEnd:
    """The gRPC server of an HTTP app (serving/app.py build_app), started on the app's event loop."""

    def __init__(self, app: Any, port: int, host: str = "127.0.0.1", api_key: str | None = None) -> None:
        self.server = app.state.server
        self.host, self.port = host or "0.0.0.0", port  # "" is every address to uvicorn too
        self.api_key = api_key
        self.grpc: grpc.aio.Server | None = None
        self.health: HealthService | None = None

    @property
    def target(self) -> str:
        """host:port to bind and connect to (the bound port, once started); [host]:port for IPv6."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        limit = min(self.server.max_request_bytes, 2**31 - 1)  # grpcio takes a 32-bit int
        self.grpc = grpc.aio.server(
            interceptors=[_ApiKey(self.api_key), _WellFormed()] if self.api_key else [_WellFormed()],
            # the HTTP side's body limit; a larger request is RESOURCE_EXHAUSTED. No port sharing:
            # a port in use is an error, not a second server answering half the calls.
            options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0),
                     # calls one connection may have open at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS)
                     ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)])
        pb_grpc.add_GenerationServicer_to_server(GenerationService(self.server), self.grpc)
        self.health = HealthService(self.server.engine)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        try:
            bound = self.grpc.add_insecure_port(self.target)
        except RuntimeError as e:  # grpcio's "Failed to bind to address ..."
            bound, cause = 0, e
        else:
            cause = None
        if bound == 0:
            raise OSError(f"could not listen for gRPC on {self.target} (--host, --grpc-port): is the port in use "
                          f"or the address not this machine's? ({cause})")
        self.port = bound
        await self.grpc.start()
        await self.health._refresh()
        logger.info("gRPC (%s) on %s", SERVICE, self.target)

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls at once; calls in flight get `grace` seconds, then are cancelled."""
        if self.grpc is None:
            return
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        await self.grpc.stop(grace)
