"""The OpenAI-compatible HTTP server: a Starlette app over an AsyncEngine.

    POST /v1/completions  POST /v1/chat/completions  GET /v1/models
    GET /health  GET /metrics  POST /tokenize  POST /detokenize  GET /version

Streaming responses are Server-Sent Events, `data: {chunk}\\n\\n` ending with `data: [DONE]`. When a
client goes away, its requests are aborted (their KV blocks are free before the next step). Every
error is OpenAI's {"error": {"message", "type", "param", "code"}} with its HTTP status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

import jaxsched
from jaxsched.core.limits import MAX_UNKNOWN_FIELDS_LOGGED
from jaxsched.core.request import SamplingParams, short_repr
from jaxsched.engine.frontend import CheckedTokens
from jaxsched.engine.outputs import RequestOutput
from jaxsched.errors import InvalidRequestError, QueueFullError
from jaxsched.structured.params import StructuredOutputsParams
from serving import reasoning
from serving.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueTimeoutError,
    RequestStream,
)
from serving.chat_tools import DEFAULT_TOOL_PARSER, ChatTools
from serving.convert import Converter
from serving.grammar_pool import GrammarBusyError, GrammarPool
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
)
from serving.request_fields import refuse_unsupported
from serving.responses import ChatResponder, CompletionResponder, Responder
from serving.streaming import EventStream, merge, sse
from serving.tool_calls import PARSERS

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
GRAMMAR_COMPILE_TIMEOUT = 10.0  # seconds a structured output's grammar may take to compile
_YIELD_TOKENS = 16  # a stream's chunk of more tokens than this lets other streams run after it
BODY_TIMEOUT = 30.0  # seconds a client may take to send a request's body (else 408: no socket held forever)
# Host headers a server bound to this machine only answers (DNS rebinding: a web page whose name
# resolves to 127.0.0.1 would otherwise reach it from the browser); any port
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
LOOPBACK_BINDS = ("127.0.0.1", "::1", "localhost")
_enc = msgspec.json.Encoder()


def error_response(err: RequestError) -> Response:
    body = _enc.encode(ErrorResponse(ErrorInfo(err.message, err.type, err.param, err.code)))
    return Response(body, status_code=err.status, media_type="application/json", headers=err.headers)


def _json(obj: Any) -> Response:
    return Response(_enc.encode(obj), media_type="application/json")


def client_of(request: Request) -> str:
    """Who sent a request, for sharing work fairly: its remote address."""
    return request.client.host if request.client is not None else ""


def allowed_hosts_for(bind: str, allowed: Sequence[str] | None) -> tuple[str, ...] | None:
    """The Host headers a server bound to `bind` answers: `allowed` when given ("*" = any), the
    loopback names when it is bound to this machine only, else any (None)."""
    if allowed:
        return None if "*" in allowed else tuple(h.lower() for h in allowed)
    return LOOPBACK_HOSTS if bind in LOOPBACK_BINDS else None


class _HostMiddleware:
    """Refuse requests whose Host header names another server (DNS rebinding), on every route."""

    def __init__(self, app: Any, hosts: Sequence[str]) -> None:
        self.app = app
        self.hosts = frozenset(hosts)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            values = [v for k, v in scope["headers"] if k == b"host"]
            # the name without its port: "localhost:8000" -> "localhost", "[::1]:8000" -> "[::1]"
            host = re.sub(r":\d*$", "", values[0].decode("latin-1").lower()) if len(values) == 1 else None
            if host not in self.hosts:
                resp = error_response(RequestError(
                    f"this server answers requests for {', '.join(sorted(self.hosts))} only (Host header "
                    f"{'missing or repeated' if host is None else short_repr(host)}); to serve other names, start it "
                    "with --allowed-hosts", status=400, code="invalid_host"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on /v1/*, as vLLM's --api-key (other routes stay open)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(sent) > 1:  # which one counts is each proxy's guess: none does
                resp = error_response(RequestError(
                    f"{len(sent)} Authorization headers: send one, 'Authorization: Bearer <key>'", status=400,
                    code="invalid_api_key"))
                await resp(scope, receive, send)
                return
            got = sent[0] if sent else b""
            if not hmac.compare_digest(got, self.expected):
                msg = "missing API key" if not got else "invalid API key"
                resp = error_response(RequestError(
                    f"{msg}: send the header 'Authorization: Bearer <key>' with the server's --api-key",
                    status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server:
    def __init__(self, engine: AsyncEngine, name: str, max_request_bytes: int,
                 trust_request_chat_template: bool = False, tool_call_parser: str | None = DEFAULT_TOOL_PARSER,
                 grammar_timeout: float = GRAMMAR_COMPILE_TIMEOUT, expose_model_path: bool = False,
                 body_timeout: float = BODY_TIMEOUT, reasoning_parser: str | None = None) -> None:
        llm = engine.engine
        self.engine = engine
        self.name = name
        self.max_request_bytes = max_request_bytes
        self.max_model_len = llm.scheduler_config.max_model_len
        self.conv = Converter(llm.tokenizer, self.max_model_len, llm.model_config.vocab_size, llm.config.max_logprobs,
                              trust_request_chat_template=trust_request_chat_template)
        # the model's files' path, shown by /v1/models only when asked (--expose-model-path)
        self.root = llm.config.model_path if expose_model_path else name
        self.body_timeout = body_timeout
        self.policy = getattr(llm.config.scheduling_policy, "name", "custom")
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"unknown --tool-call-parser {tool_call_parser!r}: one of {', '.join(sorted(PARSERS))}")
        self.tool_call_parser = tool_call_parser
        self.reasoning = reasoning.reasoning_parser(reasoning_parser)
        # Grammars compile here, on their own threads with a time limit, before the request reaches
        # a core. A core in this process shares this compiler, so the compiled grammar travels with
        # the request (GrammarCompiler.compile) and its loop never compiles one; a core in a process
        # of its own compiles its own copy from the grammar's text, once per text (its cache)
        self.grammars = llm.grammars
        self.grammar_timeout = grammar_timeout
        self.grammar_pool = GrammarPool(2)  # shared fairly by client (serving/grammar_pool.py)
        threading.Thread(target=self._convert_tokenizer, name="grammar-tokenizer", daemon=True).start()  # once

    def _convert_tokenizer(self) -> None:
        try:
            self.grammars.ll_tokenizer()
        except Exception as e:  # noqa: BLE001 - said again, as a 400, to each request that needs it
            logger.warning("structured outputs will not be available: %s", e)

    async def compile_grammar(self, so: StructuredOutputsParams | None, source: str | None, client: str = "") -> None:
        """Compile a request's grammar off the event loop and the engine's thread: a 400 naming the
        problem, and the request field it came from (`source`), for a definition that does not
        compile or takes longer than the time limit."""
        if so is None:
            return
        object.__setattr__(so, "_source", source)  # frozen: a note for respond(), not a field
        try:
            await self.grammar_pool.run(client, lambda: self.grammars.compile(so), self.grammar_timeout)
        except GrammarBusyError as e:
            raise RequestError(str(e), status=429, param=source, code="grammar_compile_busy",
                               headers={"Retry-After": str(max(1, round(self.grammar_timeout)))}) from None
        except TimeoutError:
            raise RequestError(f"the structured output's {so.kind} took more than {self.grammar_timeout:g} s to "
                               f"compile: simplify it ({source})", param=source,
                               code="grammar_compile_timeout") from None
        except InvalidRequestError as e:
            param = e.param if source == "structured_outputs" else source
            raise RequestError(f"{e} ({source})" if source != "structured_outputs" else str(e), param=param) from e

    def check_priority(self, priority: int) -> None:
        if priority and self.policy == "fcfs":
            raise RequestError(f"priority {priority} is not honoured: this server schedules first come, first "
                               "served; leave priority at 0, or start the server with --scheduling-policy priority",
                               param="priority", code="unsupported_parameter")

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the prompt's last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len
        if not isinstance(keep, int) or not 1 <= keep <= self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, {self.max_model_len}], "
                               f"got {keep}", param="truncate_prompt_tokens")
        return ids[-keep:]

    # -- plumbing ------------------------------------------------------------------------------
    async def body(self, request: Request) -> bytes:
        """The JSON body of a POST. Only application/json is taken: text/plain and form bodies are
        what a web page can make a browser send to a local server without asking (CORS "simple"
        requests), so they never reach a route."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            got = f"Content-Type {media_type!r}" if media_type else "no Content-Type"
            raise RequestError(f"the request body must be JSON, sent with 'Content-Type: application/json' (got {got})",
                               status=415, code="unsupported_media_type")
        limit = self.max_request_bytes
        too_big = RequestError(f"the request body is larger than the server's limit of {limit} bytes "
                               "(--max-request-bytes)", status=413, code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.body_timeout:g} s ({size} bytes "
                               "came): send the whole body at once", status=408, code="request_timeout",
                               headers={"Connection": "close"}) from None
        return b"".join(chunks)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            shown = model if len(model) <= 200 else model[:200] + "..."  # not a megabyte echoed back
            raise RequestError(f"the model `{shown}` does not exist; this server serves `{self.name}`",
                               status=404, param="model", code="model_not_found")

    async def submit(self, r: Responder, prompts: list[list[int]], params: list[Any]) -> list[RequestStream]:
        """Queue one engine request per prompt; all are accepted or none is."""
        return await self.add_requests([f"{r.rid}-{i}" for i in range(len(prompts))], prompts, r.texts, params,
                                       r.req.priority, r.req.cache_salt, r.prompt_param, timeout=r.req.timeout)

    async def add_requests(self, request_ids: list[str], prompts: list[list[int]], texts: list[str | None],
                           params: list[Any], priority: int, cache_salt: str | None,
                           prompt_param: str = "prompt", timeout: float | None = None) -> list[RequestStream]:
        """Queue one engine request per prompt; all are accepted or none is. The prompts are the
        converter's (every id checked there, off the event loop). The engine's refusals are
        RequestErrors: a full queue 503 with Retry-After, a stopped engine 503, bad input 400."""
        # the converter checked every id on a worker thread: the engine takes them as they are
        res = await asyncio.gather(*(
            self.engine.add_request(CheckedTokens(ids, text, cache_salt), sp, request_id=rid,
                                    priority=priority, timeout=timeout)
            for rid, ids, text, sp in zip(request_ids, prompts, texts, params)), return_exceptions=True)
        errors = [x for x in res if isinstance(x, BaseException)]
        if errors:
            for x in res:
                if isinstance(x, RequestStream):
                    x.close()
            e = errors[0]
            if isinstance(e, QueueFullError):
                raise RequestError(str(e), status=503, code="server_overloaded", headers={"Retry-After": "1"})
            if isinstance(e, EngineDeadError):
                raise RequestError(str(e), status=503, code="engine_dead")
            if isinstance(e, InvalidRequestError):  # the engine's own checks (LLMEngine.make_request)
                raise RequestError(str(e), param=prompt_param if e.param == "prompt" else e.param)
            raise e
        return list(res)

    async def until_disconnect(self, request: Request, work: Any) -> Any:
        """Run `work`; if the client leaves first, cancel it (which aborts its requests)."""
        task = asyncio.ensure_future(work)

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():  # the client left: stop the work, and let the cancellation land
                task.cancel()
                await asyncio.wait({task})
        if task.cancelled():
            return Response(status_code=499)  # nobody reads it
        return task.result()

    # -- the OpenAI routes ---------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req, unknown = decode_request(await self.body(request), CompletionRequest)
        _log_unknown(unknown, "/v1/completions")
        self.check_model(req.model)
        prompts, params = await self.completion_inputs(req, client_of(request))
        r = CompletionResponder(self.conv, f"cmpl-{req.request_id or uuid.uuid4().hex}", self.name, req,
                                [len(ids) for ids, _ in prompts], [text for _, text in prompts])
        return await self.respond(request, r, [ids for ids, _ in prompts], params)

    async def completion_inputs(self, req: CompletionRequest, client: str = "") -> tuple[list[tuple[list[int], str | None]],
                                                                       list[SamplingParams]]:
        """A completion request's (prompt ids, prompt text) and SamplingParams, one per prompt, with
        every check (the gRPC front end's Generate goes through here too), its grammar compiled."""
        refuse_unsupported(req, "completions")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of is not supported by this server (leave it unset or equal to n)",
                               param="best_of")
        self.check_priority(req.priority)
        so, source = self.conv.structured_outputs(req)
        texts = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        self.conv.check_allowed_total(req, len(req.prompt) if texts else 1)  # before tokenizing the prompts
        prompts = await self.conv.completion_prompts(req.prompt, req.add_special_tokens)
        prompts = [(self.truncate(ids, req.truncate_prompt_tokens), text) for ids, text in prompts]
        params = self.conv.sampling_params(req, [len(ids) for ids, _ in prompts], req.max_tokens, req.logprobs, so)
        await self.compile_grammar(so, source, client)
        return prompts, params

    async def chat(self, request: Request) -> Response:
        req, unknown = decode_request(await self.body(request), ChatCompletionRequest)
        _log_unknown(unknown, "/v1/chat/completions")
        self.check_model(req.model)
        refuse_unsupported(req, "chat")
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_priority(req.priority)
        tools = ChatTools.from_request(req, self.tool_call_parser)
        so, source = self.conv.structured_outputs(req, tools.structured_outputs() if tools else None)
        ids = await self.conv.chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                          req.chat_template, tools=tools.tools if tools else None,
                                          tool_parser=tools.parser if tools else DEFAULT_TOOL_PARSER,
                                          continue_final_message=req.continue_final_message,
                                          add_special_tokens=req.add_special_tokens)
        ids = self.truncate(ids, req.truncate_prompt_tokens)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        [sp] = self.conv.sampling_params(req, [len(ids)], max_tokens,
                                         (req.top_logprobs or 0) if req.logprobs else None, so)
        await self.compile_grammar(so, source, client_of(request))
        r = ChatResponder(self.conv, f"chatcmpl-{req.request_id or uuid.uuid4().hex}", self.name, req, [len(ids)],
                          [None])
        r.tools = tools
        if req.include_reasoning is False and self.reasoning is None:
            raise RequestError("include_reasoning=false needs a server that separates reasoning from the reply: "
                               "start it with --reasoning-parser, or leave include_reasoning out",
                               param="include_reasoning")
        r.reasoning, r.include_reasoning = self.reasoning, req.include_reasoning is not False
        return await self.respond(request, r, [ids], [sp])

    async def respond(self, request: Request, r: Responder, prompts: list[list[int]], params: list[Any]) -> Response:
        r.grammar_source = getattr(params[0].structured_outputs, "_source", None)
        streams = await self.submit(r, prompts, params)
        if r.req.stream:
            return EventStream(self.stream(r, streams))
        return await self.until_disconnect(request, self.collect(r, streams))

    async def collect(self, r: Responder, streams: list[RequestStream]) -> Response:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge(streams):
                finals[i] = out
        except (EngineDeadError, EngineStepError) as e:
            raise engine_failure(e, r.grammar_source) from e
        finally:
            for s in streams:
                s.close()
        choices: list[Any] = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(r.choice(i, c))
        return _json(r.response(choices, r.usage(completion_tokens), [out.prompt_logprobs for out in finals]))

    async def stream(self, r: Responder, streams: list[RequestStream]) -> AsyncIterator[bytes]:
        completion_tokens = 0
        try:
            for chunk in r.opening():
                yield sse(chunk)
            prompt_logprobs: dict[int, Any] = {}  # prompt -> its prompt logprobs, until a chunk takes them
            async for i, out in merge(streams):  # DELTA outputs: what is new since the last one read
                if out.prompt_logprobs is not None:  # (in its first delta only)
                    prompt_logprobs[i] = r.conv.prompt_logprobs(out.prompt_logprobs)
                for d in sorted(out.outputs, key=lambda c: c.index):
                    completion_tokens += len(d.token_ids)
                    if d.text or d.finish_reason or d.logprobs:
                        choice = r.delta_choice(i, d)
                        if choice is not None:
                            yield sse(r.chunk([choice], prompt_logprobs=prompt_logprobs.pop(i, None)))
                            if len(d.token_ids) > _YIELD_TOKENS:
                                # a delta merged while its client read slowly is a large chunk to
                                # build: the other streams' turn comes between two of them (a send
                                # that does not block would not let them run)
                                await asyncio.sleep(0)
            if r.include_usage:
                yield sse(r.chunk([], r.usage(completion_tokens)))
        except QueueTimeoutError as e:
            yield sse(ErrorResponse(ErrorInfo(str(e), "server_overloaded", None, "queue_timeout")))
        except (EngineDeadError, EngineStepError) as e:  # shutdown, or this request failed alone
            err = engine_failure(e, r.grammar_source)
            if err.status >= 500 and err.status != 503:
                err = server_error(err.message, f"stream {short_repr(r.rid, 80)} ended", status=err.status,
                                   code=err.code or "internal_error")
            else:
                logger.info("stream %s ended: %s", short_repr(r.rid, 80), e)
            yield sse(ErrorResponse(ErrorInfo(err.message, err.type, err.param, err.code)))
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            err = server_error(f"{type(e).__name__}: {e}", f"stream {short_repr(r.rid, 80)} failed", exc=e)
            yield sse(ErrorResponse(ErrorInfo(err.message, err.type, None, err.code)))
        finally:
            for s in streams:
                s.close()
        yield b"data: [DONE]\n\n"

    # -- the other routes ----------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        card = ModelCard(self.name, "model", int(time.time()), "jaxsched", self.root, self.max_model_len)
        return _json(ModelList("list", [card]))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.engine.is_running and self.engine.stalled() is None else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(model_name=self.name), media_type=CONTENT_TYPE_LATEST)

    async def version(self, request: Request) -> Response:
        return _json({"version": jaxsched.__version__})

    async def tokenize(self, request: Request) -> Response:
        req, _ = decode_request(await self.body(request), TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("pass exactly one of prompt (a string) or messages (a chat)", param="prompt")
        # counting tokens is this route's purpose, so a text longer than max_model_len is tokenized too
        if req.prompt is not None:
            ids = await self.conv.tokenize(req.prompt, add_special_tokens=req.add_special_tokens, limit=False)
        else:
            ids = await self.conv.chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                              req.chat_template, limit=False)
        return _json(TokenizeResponse(len(ids), self.max_model_len, ids))

    async def detokenize(self, request: Request) -> Response:
        req, _ = decode_request(await self.body(request), DetokenizeRequest)
        self.check_model(req.model)
        return _json(DetokenizeResponse(await self.conv.detokenize(req.tokens)))


def _log_unknown(unknown: list[str], route: str) -> None:
    if unknown:
        names = [u[:40] for u in unknown[:MAX_UNKNOWN_FIELDS_LOGGED]]  # (the list's repr escapes them)
        more = f" and {len(unknown) - len(names)} more" if len(unknown) > len(names) else ""
        logger.warning("%s: ignoring unknown fields %s%s", route, names, more)


def engine_failure(e: EngineDeadError | EngineStepError, grammar_source: str | None = None) -> RequestError:
    """What the client gets when the engine ended its request: 503 while shutting down; 400 naming
    the field when the request's own input made it fail (its grammar's: the field it came in,
    `grammar_source`, when known); else 500 (the others in its step went on)."""
    if isinstance(e, EngineDeadError):
        return RequestError(str(e), status=503, code="engine_dead")
    if e.param is not None:
        param = grammar_source if e.param == "structured_outputs" and grammar_source else e.param
        return RequestError(str(e), param=param)
    return RequestError(str(e), status=500, code="request_failed")


def server_error(message: str, where: str, exc: BaseException | None = None, status: int = 500,
                 code: str = "internal_error") -> RequestError:
    """A 5xx for the client: the log gets what went wrong, under an id; the client the id alone
    (no exception of the server's in a response)."""
    ref = uuid.uuid4().hex[:12]
    logger.error("[error %s] %s: %s", ref, where, message, exc_info=exc)
    return RequestError(f"the server failed this request (error id {ref}, in its log); retry it, or report the id",
                        status=status, code=code)


def _endpoint_error(request: Request, e: RequestError) -> Response:
    if e.status >= 500 and e.status != 503:  # 503s say why (overloaded, shutting down): the client may act on it
        e = server_error(e.message, f"{request.method} {request.url.path}", status=e.status, code=e.code or "internal_error")
    return error_response(e)


def _wrap(handler: Any) -> Any:
    async def endpoint(request: Request) -> Any:
        try:
            return await handler(request)
        except RequestError as e:
            return _endpoint_error(request, e)
        except InvalidRequestError as e:  # the engine's own checks, wherever they run
            return error_response(RequestError(str(e), param=e.param))
        except (EngineDeadError, EngineStepError) as e:  # shut down, or this request failed alone
            return _endpoint_error(request, engine_failure(e))
        except QueueTimeoutError as e:
            return error_response(RequestError(str(e), status=503, code="queue_timeout", headers={"Retry-After": "1"}))
        except ClientDisconnect:  # gone while sending its body: nobody reads the reply
            return Response(status_code=499)

    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(RequestError(f"{exc.detail}: {request.method} {request.url.path}", status=exc.status_code,
                                       code=code, headers=dict(exc.headers or {})))


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(server_error(f"{type(exc).__name__}: {exc}", f"{request.method} {request.url.path}",
                                       exc=exc))


def build_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, trust_request_chat_template: bool = False,
              tool_call_parser: str | None = DEFAULT_TOOL_PARSER,
              grammar_timeout: float = GRAMMAR_COMPILE_TIMEOUT, allowed_hosts: Sequence[str] | None = None,
              expose_model_path: bool = False, body_timeout: float = BODY_TIMEOUT,
              reasoning_parser: str | None = None) -> Starlette:
    """The server's ASGI app. `served_model_name` defaults to the model's path; `api_key` guards
    /v1/*; chat templates sent in requests are refused unless `trust_request_chat_template`;
    `tool_call_parser` reads tool calls out of the model's text (tool_choice "auto"; None refuses
    it); a grammar that takes longer than `grammar_timeout` seconds to compile gets a 400. Beyond
    the engine's max_num_queued_requests (EngineArgs) queued requests, new ones get 503 with Retry-After.
    `allowed_hosts`: the Host headers answered (allowed_hosts_for), None = any; `expose_model_path`
    shows the model's path in /v1/models; a body slower than `body_timeout` seconds gets a 408;
    `reasoning_parser` separates chat outputs' reasoning_content from their content (reasoning.py)."""
    name = served_model_name or engine.engine.config.model_path
    s = _Server(engine, name, max_request_bytes, trust_request_chat_template, tool_call_parser, grammar_timeout,
                expose_model_path, body_timeout, reasoning_parser)
    routes = [
        Route("/v1/completions", _wrap(s.completions), methods=["POST"]),
        Route("/v1/chat/completions", _wrap(s.chat), methods=["POST"]),
        Route("/v1/models", _wrap(s.models), methods=["GET"]),
        Route("/health", _wrap(s.health), methods=["GET"]),
        Route("/metrics", _wrap(s.metrics), methods=["GET"]),
        Route("/version", _wrap(s.version), methods=["GET"]),
        Route("/tokenize", _wrap(s.tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(s.detokenize), methods=["POST"]),
    ]
    middleware = [Middleware(_HostMiddleware, hosts=allowed_hosts)] if allowed_hosts is not None else []
    middleware += [Middleware(_ApiKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = s
    return app
