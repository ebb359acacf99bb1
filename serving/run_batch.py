"""`jaxsched run-batch`: a file of OpenAI batch requests, run offline, as vLLM's `run-batch`.

    jaxsched run-batch -i requests.jsonl -o results.jsonl [MODEL] [engine flags] [--error-file errors.jsonl]

Each input line is one request of OpenAI's batch file format:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

and each gets one output line, in input order:

    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "chatcmpl-...",
     "body": {...the server's response...}}, "error": null}

One validation path. Every body goes through the HTTP server's own ASGI app (serving/app.py), called
in this process without a socket: the same msgspec request types, conversion, checks and response
builders, so a body the server answers with 400 gets the same status and message here, and a body it
answers gets the same response. What is checked here is only what the server never sees: the line's
envelope (JSON, custom_id, method, url, body) and streaming, which a file cannot carry.

A line that fails, whatever the reason, gets `response.body = null`, the status the server would
give, and the server's error object (`{"message", "type", "param", "code"}`) as `error`; the batch
goes on (vLLM stops the whole run at a malformed line). OpenAI's batch output differs in one way: it
keeps an HTTP failure's `{"error": ...}` in `response.body` and sets `error` only for failures that
have no response; here `error` is always the place to look. custom_ids must be unique, as OpenAI
requires: a repeated one is an error line (the first line with that id runs). Blank lines are skipped.

Lines enter the engine as the file is read, at most --max-in-flight lines at a time, so a file larger
than memory runs; outputs are written in input order, so what is held is the lines in flight and the
finished results that wait for an earlier line. A line longer than --max-line-bytes is an error line
without being parsed.

No result is lost. Results go to a temporary file beside the output, renamed over it when the run
ends: a run that cannot start (a wrong model path) or is killed leaves an existing output file as it
was. With --resume they are appended to the output itself, each line flushed as it is written; the
custom_ids of its complete lines are skipped and a line torn by a kill is cut, so a killed run
resumed has every custom_id once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import msgspec
from msgspec import Struct

from serving.protocol import ErrorInfo, ErrorResponse, RequestError, UsageInfo

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_MAX_LINE_BYTES = 8 * 2**20 + 64 * 2**10  # the server's body limit, and room for the envelope
MAX_IN_FLIGHT_PER_SEQ = 4  # default --max-in-flight: this many lines per engine seat keeps the scheduler fed


# -- the file formats --------------------------------------------------------------------------
class _InputLine(Struct):
    """One input line. Fields are Any so that each fault gets a message of its own here rather than
    msgspec's first complaint; the body stays raw bytes and reaches the server as they are."""

    custom_id: Any = None
    method: Any = None
    url: Any = None
    body: msgspec.Raw = msgspec.Raw()  # empty when the line has none


class _StreamProbe(Struct):
    stream: Any = None


class _ResponseProbe(Struct):
    """What the runner reads of a server response: its id (the line's request_id) and usage (the bar's tok/s)."""

    id: str | None = None
    usage: UsageInfo | None = None


class _IdProbe(Struct):
    custom_id: Any = None


class BatchResponse(Struct):
    status_code: int
    request_id: str
    body: Any  # the server's response body as it sent it (a msgspec.Raw), or None for a failed line


class BatchOutput(Struct):
    id: str
    custom_id: str | None
    response: BatchResponse
    error: ErrorInfo | None


_enc = msgspec.json.Encoder()
_line_decoder = msgspec.json.Decoder(_InputLine)
_stream_decoder = msgspec.json.Decoder(_StreamProbe)
_response_decoder = msgspec.json.Decoder(_ResponseProbe)
_error_decoder = msgspec.json.Decoder(ErrorResponse)
_id_decoder = msgspec.json.Decoder(_IdProbe)


@dataclass
class BatchSummary:
    lines: int = 0
    failed: int = 0
    output_tokens: int = 0
    seconds: float = 0.0


# -- one line ----------------------------------------------------------------------------------
class _LineError(Exception):
    """A line refused before it reaches the server (its envelope, or a streaming body)."""

    def __init__(self, err: RequestError, custom_id: str | None = None) -> None:
        super().__init__(err.message)
        self.err = err
        self.custom_id = custom_id  # once it could be read, so that the error line can be matched


def _parse(lineno: int, raw: bytes, seen: dict[str, int]) -> tuple[str | None, str, bytes]:
    """(custom_id, url, body) of one input line; raises _LineError naming what is wrong."""
    try:
        line = _line_decoder.decode(raw)
    except msgspec.ValidationError as e:  # valid JSON, but not an object
        raise _LineError(RequestError(f"line {lineno} must be a JSON object "
                                      "{\"custom_id\", \"method\", \"url\", \"body\"}: " + str(e),
                                      code="invalid_json")) from e
    except msgspec.DecodeError as e:
        raise _LineError(RequestError(f"line {lineno} is not valid JSON: {e}", code="invalid_json")) from e
    cid = line.custom_id if isinstance(line.custom_id, str) else None
    try:
        if line.custom_id is None:
            raise RequestError(f"line {lineno} has no custom_id: every request needs a unique custom_id (a "
                               "string) to match its output", param="custom_id", code="missing_custom_id")
        if cid is None:
            raise RequestError(f"custom_id must be a string, got {type(line.custom_id).__name__}",
                               param="custom_id", code="invalid_type")
        if cid in seen:
            raise RequestError(f"custom_id {cid!r} is already used by line {seen[cid]}: custom_ids must be unique "
                               "within a batch (this line was not run)", param="custom_id",
                               code="duplicate_custom_id")
        if line.method != "POST":
            raise RequestError(f"method must be \"POST\", got {_short(line.method)}", status=405, param="method",
                               code="method_not_allowed")
        if line.url not in URLS:
            what = f"line {lineno} has no url" if line.url is None else \
                f"url {_short(line.url)} is not served by run-batch"
            raise RequestError(f"{what}: use one of {', '.join(URLS)}", status=404, param="url", code="not_found")
        body = bytes(line.body)
        if not body or body == b"null":
            raise RequestError(f"line {lineno} has no body: put the request (the JSON object you would POST to "
                               f"{line.url}) in \"body\"", param="body", code="missing_body")
        try:
            stream = _stream_decoder.decode(body).stream
        except msgspec.ValidationError:  # not an object: the server says so, in its own words
            stream = None
        if stream is True:
            raise RequestError("stream=true is not supported in a batch file: each line gets one whole response; "
                               "drop \"stream\" (or set it to false)", param="stream", code="stream_not_supported")
        seen[cid] = lineno  # claimed by a line that runs: a refused line leaves its id to a later one
        return cid, line.url, body
    except RequestError as e:
        raise _LineError(e, cid) from None


def _short(value: Any) -> str:
    s = repr(value) if value is not None else "nothing"
    return s if len(s) <= 60 else s[:57] + "..."


async def _call_app(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` to `path` of the server's ASGI app, in this process; returns (status, body)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": None, "server": None,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # a batch line never disconnects: the server's disconnect watcher waits here until it is cancelled
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    status = 500
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:  # Starlette re-raises after its 500 handler has sent the response
        if not chunks:
            raise
    return status, b"".join(chunks)


def _error_line(cid: str | None, status: int, err: ErrorInfo) -> BatchOutput:
    return BatchOutput(f"batch_req_{uuid.uuid4().hex}", cid, BatchResponse(status, f"req_{uuid.uuid4().hex}", None),
                       err)


def _refused(cid: str | None, e: RequestError) -> BatchOutput:
    return _error_line(cid, e.status, ErrorInfo(e.message, e.type, e.param, e.code))


# -- the run -----------------------------------------------------------------------------------
class _OrderedWriter:
    """Writes finished lines in input order; holds those that wait for an earlier line. flush:
    each line reaches the file as it is written (--resume's output: a kill loses no written line)."""

    def __init__(self, out: IO[bytes], error_out: IO[bytes] | None, on_written: Any = None,
                 flush: bool = False) -> None:
        self.out, self.error_out = out, error_out
        self.flush = flush
        self.next = 0
        self.waiting: dict[int, tuple[bytes, bool]] = {}
        self.on_written = on_written  # called once per line written

    def put(self, index: int, record: BatchOutput) -> None:
        self.waiting[index] = (_enc.encode(record) + b"\n", record.error is not None)
        while self.next in self.waiting:
            data, failed = self.waiting.pop(self.next)
            self.out.write(data)
            if failed and self.error_out is not None:
                self.error_out.write(data)
            if self.flush:
                self.out.flush()
                if failed and self.error_out is not None:
                    self.error_out.flush()
            self.next += 1
            if self.on_written is not None:
                self.on_written()


class BatchRunner:
    """Runs batch lines through the server's ASGI app (serving.app.build_app over an AsyncEngine)."""

    def __init__(self, app: Any, max_in_flight: int, progress: Any = None, done: set[str] | frozenset[str] = frozenset(),
                 flush: bool = False) -> None:
        if max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be >= 1, got {max_in_flight}")
        self.app = app
        self.done = done  # custom_ids already in the output (--resume): their lines are skipped
        self.flush = flush
        self.max_in_flight = max_in_flight
        self.progress = progress  # a tqdm bar, or None
        self.summary = BatchSummary()
        self._t0 = 0.0

    async def run(self, lines: Iterable[bytes], out: IO[bytes], error_out: IO[bytes] | None = None) -> BatchSummary:
        # A line holds a slot from when it is read until it is written: the lines in the engine plus
        # the finished ones waiting for an earlier line stay within max_in_flight, so memory is bounded
        # however long the line at the head runs.
        slots = asyncio.Semaphore(self.max_in_flight)
        writer = _OrderedWriter(out, error_out, on_written=slots.release, flush=self.flush)
        tasks: set[asyncio.Task] = set()
        seen: dict[str, int] = {}
        self._t0 = time.perf_counter()
        index = 0
        async for lineno, raw in _numbered(lines):
            if self.done and _done_id(raw) in self.done:
                continue  # --resume: its result is in the output already
            i, index = index, index + 1
            await slots.acquire()  # the bound: a line is read only when an earlier one was written
            try:
                if isinstance(raw, _TooLong):
                    raise _LineError(RequestError(
                        f"line {lineno} is {raw.size} bytes or more, longer than the limit of {raw.limit} "
                        "(--max-line-bytes): it was not read", code="line_too_long"))
                cid, url, body = _parse(lineno, raw, seen)
            except _LineError as e:
                self._finish(writer, i, _refused(e.custom_id, e.err))
                continue
            task = asyncio.create_task(self._one(writer, i, cid, url, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        self.summary.seconds = time.perf_counter() - self._t0
        return self.summary

    async def _one(self, writer: _OrderedWriter, index: int, cid: str | None, url: str, body: bytes) -> None:
        try:
            status, resp = await _call_app(self.app, url, body)
            record = self._record(cid, status, resp)
        except Exception as e:  # one line's failure must not end the batch
            logger.exception("custom_id %r failed", cid)
            record = _error_line(cid, 500, ErrorInfo(f"internal error: {type(e).__name__}: {e}", "server_error",
                                                     None, "internal_error"))
        self._finish(writer, index, record)

    def _record(self, cid: str | None, status: int, resp: bytes) -> BatchOutput:
        if status == 200:
            probe = _response_decoder.decode(resp)
            if probe.usage is not None:
                self.summary.output_tokens += probe.usage.completion_tokens
            return BatchOutput(f"batch_req_{uuid.uuid4().hex}", cid,
                               BatchResponse(status, probe.id or f"req_{uuid.uuid4().hex}", msgspec.Raw(resp)), None)
        try:
            err = _error_decoder.decode(resp).error
        except msgspec.MsgspecError:  # not the server's error shape (it always sends it; be safe)
            err = ErrorInfo(f"HTTP {status}: {resp[:200].decode(errors='replace')}",
                            "server_error" if status >= 500 else "invalid_request_error", None, None)
        return _error_line(cid, status, err)

    def _finish(self, writer: _OrderedWriter, index: int, record: BatchOutput) -> None:
        s = self.summary
        s.lines += 1
        s.failed += record.error is not None
        writer.put(index, record)
        if self.progress is not None:
            dt = time.perf_counter() - self._t0
            self.progress.set_postfix_str(f"output {s.output_tokens / dt if dt > 0 else 0.0:.1f} tok/s, "
                                          f"{s.failed} failed", refresh=False)
            self.progress.update(1)


@dataclass
class _TooLong:
    """A line longer than the limit, in place of its bytes (never held whole)."""

    size: int
    limit: int


def read_lines(f: IO[bytes], limit: int) -> Iterator[bytes | _TooLong]:
    """The lines of `f`, each read only up to `limit` bytes: a longer one is skipped to its end
    in pieces and given as _TooLong."""
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        size = len(raw)
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            size += len(raw)
        yield _TooLong(size, limit)


def _done_id(raw: bytes | _TooLong) -> str | None:
    """A line's custom_id, when it is a readable string (for --resume's skip)."""
    if isinstance(raw, _TooLong):
        return None
    try:
        cid = _id_decoder.decode(raw).custom_id
    except msgspec.MsgspecError:
        return None
    return cid if isinstance(cid, str) else None


async def _numbered(lines: Iterable[bytes | _TooLong]) -> AsyncIterator[tuple[int, bytes | _TooLong]]:
    """(1-based line number, line) of the non-blank lines. Reading a line blocks the loop briefly; the
    engine runs on its own thread meanwhile, and the lines in flight wait on it, not on the loop."""
    for lineno, raw in enumerate(lines, 1):
        if isinstance(raw, _TooLong) or raw.strip():
            yield lineno, raw
        if lineno % 256 == 0:
            await asyncio.sleep(0)  # let finished lines be written while blank or refused lines stream by


def _count_lines(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return sum(1 for raw in f if raw.strip())
    except OSError:
        return None


# -- the command ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """run-batch's own flags (the engine flags are added by cli.add_engine_flags)."""
    parser.add_argument("model", nargs="?", default=None, help="a Hugging Face model folder, .gguf file or Hub id "
                        "(default: the demo model)")
    parser.add_argument("-i", "--input-file", required=True, help="the batch file: one request per line (JSONL)")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where one result per input line is written, in input order (JSONL)")
    parser.add_argument("--error-file", default=None,
                        help="also write the failed lines here, as OpenAI's batch writes an error file")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="lines of the file in the engine at once, each one or more engine requests (a list "
                             f"of prompts, n > 1) (default: {MAX_IN_FLIGHT_PER_SEQ} x max_num_seqs x "
                             "data_parallel_size, at most max_num_queued_requests)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name bodies pass as `model` (default: MODEL, as `serve`)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat templates sent in bodies, as `serve` (refused by default)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar (there is none off a terminal)")
    parser.add_argument("--resume", action="store_true",
                        help="go on with an interrupted run: keep the output file's complete lines, skip their "
                             "custom_ids, and append the rest (each line flushed as written). Without it the output "
                             "is written to a temporary file and replaces OUTPUT_FILE only when the run ends")
    parser.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES,
                        help="a longer input line is an error line, not read (default: %(default)s)")


def default_max_in_flight(args: Any) -> int:
    n = MAX_IN_FLIGHT_PER_SEQ * args.max_num_seqs * args.data_parallel_size
    if args.max_num_queued_requests is not None:  # beyond it the server's answer is 503 (server_overloaded)
        n = min(n, args.max_num_queued_requests)
    return n


def cmd_run_batch(ns: argparse.Namespace, args: Any) -> int:
    """The `jaxsched run-batch` command; `args` are the EngineArgs of the command line."""
    from jaxsched.engine.llm_engine import create_engine
    from serving.app import build_app
    from serving.async_engine import AsyncEngine

    max_in_flight = ns.max_in_flight if ns.max_in_flight is not None else default_max_in_flight(args)
    if max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {max_in_flight}")
    # the files are opened before the model loads (minutes), so that a wrong path fails at once;
    # on a multi-host engine only process 0 reads and writes them, after it knows it is process 0
    multi_host = args.distributed_coordinator is not None
    files = None if multi_host else _open_files(ns)
    if files is None and not multi_host:
        return 1
    try:
        eng = create_engine(args)
    except BaseException:
        _close(files)
        raise
    if multi_host:
        if not eng.is_leader:  # the other hosts run process 0's steps until it stops
            eng.follow()
            return 0
        files = _open_files(ns)
        if files is None:
            eng.shutdown()
            return 1
    src, out, err = files
    name = ns.served_model_name or ns.model or "demo"
    engine = AsyncEngine(eng)
    app = build_app(engine, served_model_name=name, trust_request_chat_template=ns.trust_request_chat_template)
    results = [r for r in (out, err) if r is not None]
    try:
        summary = asyncio.run(_run_with_bar(app, ns, src, out, err, max_in_flight))
        # the engine thread ends only on shutdown: if it is gone, the lines after that failed with 503
        dead = not engine.is_running
    except BaseException:
        for r in results:  # a run that did not end leaves the output as it was (--resume: what it wrote)
            if ns.resume:
                r.commit()
            else:
                r.discard()
        raise
    finally:
        engine.shutdown(timeout=None if multi_host else 10.0)
        if multi_host:
            eng.shutdown()
        src.close()
    for r in results:
        r.commit()
    logger.info("run-batch: %d lines, %d failed, %d output tokens in %.1f s (%.1f output tok/s) -> %s%s",
                summary.lines, summary.failed, summary.output_tokens, summary.seconds,
                summary.output_tokens / summary.seconds if summary.seconds else 0.0, ns.output_file,
                f" (failures also in {ns.error_file})" if ns.error_file else "")
    if dead:
        print("error: the engine stopped during the run; the lines after that failed (see the output file)",
              file=sys.stderr)
        return 1
    return 0


def _close(files: tuple[IO[bytes], ResultFile, ResultFile | None] | None) -> None:
    """A run that did not start: the input closed, the results' temporary files removed."""
    if files is None:
        return
    files[0].close()
    for r in files[1:]:
        if r is not None:
            r.discard()


async def _run_with_bar(app: Any, ns: argparse.Namespace, src: IO[bytes], out: ResultFile, err: ResultFile | None,
                        max_in_flight: int) -> BatchSummary:
    from tqdm import tqdm

    show = not ns.disable_tqdm and sys.stderr.isatty()
    total = _count_lines(ns.input_file) if show else None  # one quick pass, for the bar's ETA
    if out.done:
        logger.info("run-batch --resume: %d lines of %s are done; the rest run", len(out.done), ns.output_file)
    for r in (out, err):
        if r is not None:
            r.begin()
    with tqdm(total=total, desc="run-batch", unit="req", disable=not show, dynamic_ncols=True) as bar:
        runner = BatchRunner(app, max_in_flight, bar if show else None, done=out.done, flush=ns.resume)
        return await runner.run(read_lines(src, ns.max_line_bytes), out.file, err.file if err else None)


class ResultFile:
    """Where a run's results (or its failed lines) go; see the module docstring. Without resume: a
    temporary file beside `path`, renamed over it by commit() and removed by discard(), so `path`
    is untouched until the run has ended. With resume: `path` itself, opened to append after its
    last complete line (a torn one is cut by begin(), once the run starts), its lines' custom_ids
    in `done`."""

    def __init__(self, path: str, resume: bool) -> None:
        self.path, self.resume = path, resume
        self.done: set[str] = set()
        self.temp: str | None = None
        self._keep = 0  # --resume: the bytes of whole lines, after which a torn one is cut
        self.created = resume and not os.path.exists(path)  # made here (removed again if the run never starts)
        if resume:
            self.file = open(path, "ab+")  # noqa: SIM115 - closed by commit() / discard()
            self._keep_complete_lines()
        else:
            folder, name = os.path.split(os.path.abspath(path))
            fd, self.temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=folder)
            self.file = os.fdopen(fd, "wb")

    def _keep_complete_lines(self) -> None:
        """Read the output's lines: every complete result line's custom_id goes to `done`, and the
        end of the last whole one is kept for begin() (a kill may have torn the line after it)."""
        f, good = self.file, 0
        f.seek(0)
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                cid = _id_decoder.decode(raw).custom_id
            except msgspec.MsgspecError:
                break
            if isinstance(cid, str):
                self.done.add(cid)
            good += len(raw)
        self._keep = good

    def begin(self) -> None:
        """The run starts: with --resume, a torn last line is cut (its request runs again)."""
        f = self.file
        if self.resume and self._keep != f.seek(0, os.SEEK_END):
            logger.warning("run-batch --resume: %s ends with a torn line (%d bytes): it is cut and its line run again",
                           self.path, f.tell() - self._keep)
            f.truncate(self._keep)
        f.seek(0, os.SEEK_END)

    def commit(self) -> None:
        self.file.close()
        if self.temp is not None:
            os.replace(self.temp, self.path)
            self.temp = None

    def discard(self) -> None:
        """The run did not start: nothing it opened stays."""
        self.file.close()
        if self.created and os.path.getsize(self.path) == 0:
            os.unlink(self.path)
        if self.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temp)
            self.temp = None


def _open_files(ns: argparse.Namespace) -> tuple[IO[bytes], ResultFile, ResultFile | None] | None:
    """The input file, the output and the error file, opened; None (after saying why) when one cannot be."""
    if ns.error_file is not None and os.path.abspath(ns.error_file) == os.path.abspath(ns.output_file):
        print("error: --error-file must differ from the output file (which gets every line already)", file=sys.stderr)
        return None
    for path in (ns.output_file, ns.error_file):  # writing it would change the input
        if path is not None and os.path.exists(path) and os.path.exists(ns.input_file) and \
                os.path.samefile(path, ns.input_file):
            print(f"error: {path!r} is the input file: write the results to another file", file=sys.stderr)
            return None
    try:
        src = open(ns.input_file, "rb")  # noqa: SIM115 - closed by cmd_run_batch
    except OSError as e:
        print(f"error: cannot read the input file {ns.input_file!r}: {e.strerror or e}", file=sys.stderr)
        return None
    opened: list[ResultFile] = []
    for path, what in ((ns.output_file, "output"), (ns.error_file, "error")):
        if path is None:
            continue
        try:
            opened.append(ResultFile(path, ns.resume))
        except OSError as e:
            print(f"error: cannot write the {what} file {path!r}: {e.strerror or e}", file=sys.stderr)
            src.close()
            for r in opened:
                r.discard()
            return None
    return src, opened[0], opened[1] if len(opened) > 1 else None
