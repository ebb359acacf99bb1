"""`jaxsched bench serve`: a load generator and latency meter for any OpenAI-compatible server
(this one, vLLM, ...), as vLLM's `vllm bench serve`.

  jaxsched serve --scheduling-policy priority &                 # or any other server
  jaxsched bench serve -n 200 --request-rate 4 --priority-share 0.2 --label priority --output-json p.json
  jaxsched bench serve -n 200 --request-rate 4 --priority-share 0.2 --label fcfs --no-priority-field \
      --compare p.json --plot out/                              # against a fcfs server: same arrivals
  jaxsched bench serve --sweep 1,2,4,8 --plot out/ --json
  jaxsched bench serve --grpc 127.0.0.1:50051                  # the same requests over jaxsched's gRPC

Requests arrive as a Poisson process at --request-rate (inf: all at once), or keep --max-concurrency
in flight, and stream (stream_options.include_usage, so output tokens are the server's count).
Per request: TTFT (to the first chunk that carries text), ITL (between such chunks), TPOT
((latency - TTFT) / (output tokens - 1)) and end-to-end latency; over the run their mean, median,
p90 and p99, request and token throughput, goodput under --goodput SLOs, and errors with their
messages. Field names are vLLM's (mean_ttft_ms, p99_itl_ms, output_throughput, ...). With --grpc
the requests are jaxsched's gRPC Generate calls (jaxsched/proto/jaxsched.proto: token ids, no text),
timed by their token messages, so one server's two front ends can be compared on one workload.

Priority classes: --priority-share 0.2 marks that share of the requests (drawn with --seed; the
same requests whatever the rate) as "high" and sends them with "priority": --high-priority, the
others with --low-priority. Lower runs first (vLLM's convention; jaxsched/core/policy.py). A fcfs
jaxsched server accepts and ignores the field; vLLM's fcfs server refuses a non-zero priority, so
--no-priority-field sends none while still reporting the classes, which is how the same arrivals
are measured under fcfs. Metrics are reported overall and per class.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxsched import envs
from jaxsched.bench import workloads
from jaxsched.bench.results import add_output_arguments, emit, summarize

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# per-request lists kept in the JSON file, left out of the one-line summary
PER_REQUEST = ("request_classes", "start_times", "ttfts", "e2els", "input_lens", "output_lens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    g.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    g.add_argument("--grpc", default=None, metavar="HOST:PORT",
                   help="send each request as a gRPC Generate call to a jaxsched server's --grpc-port instead "
                        "(completions only; --extra-body fields go to sampling_params)")
    g.add_argument("--model", default=None, help="the model name to send (default: the server's first in /v1/models)")
    g.add_argument("--api-key", default=None, help="Bearer key (default: $OPENAI_API_KEY, else $JAXSCHED_API_KEY)")
    g.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf: counts ShareGPT replies' tokens for their output lengths")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    workloads.add_workload_arguments(p)
    g = p.add_argument_group("load")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload, the arrivals and the classes")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--sweep", default=None, metavar="R1,R2,...",
                   help="run once per request rate (one result each, same arrivals scaled); 'inf' allowed")
    g.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent one by one before the clock starts (a failure stops the benchmark)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos, so every request produces its max tokens (default: on)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, metavar="JSON", help="fields merged into every request body")
    g.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs a request must meet to count as good: ttft, tpot and/or e2el in ms, e.g. ttft:500 tpot:50")
    g = p.add_argument_group("priority classes")
    g.add_argument("--priority-share", type=float, default=0.0,
                   help="share of the requests in the high-priority class (0 to 1; default 0: one class)")
    g.add_argument("--high-priority", type=int, default=-10,
                   help="priority sent with high-class requests (default -10; lower runs first). On a jaxsched "
                        "server a waiting request gains a level every aging_steps (512) steps, so a gap of 10 "
                        "levels keeps the class ahead of requests up to 5120 steps older")
    g.add_argument("--low-priority", type=int, default=0, help="priority sent with the other requests (default 0)")
    g.add_argument("--no-priority-field", action="store_true",
                   help="send no priority field (a fcfs vLLM server refuses one); classes are still reported. "
                        "Automatic when --priority-share is 0")
    g = p.add_argument_group("report")
    g.add_argument("--label", default=None, help="this run's name in the result and in plots (e.g. fcfs, priority)")
    g.add_argument("--compare", action="append", default=[], metavar="FILE",
                   help="an earlier serve result (--output-json) drawn with this one in the CDF plot; repeatable")
    add_output_arguments(p)


@dataclass
class Outcome:
    """What one request did; times in seconds, start relative to the benchmark's start."""

    cls: str
    start: float = 0.0
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        """(latency - TTFT) / (output tokens - 1): 0 with one output token (vLLM's definition)."""
        if self.output_tokens <= 1 or self.ttft is None:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or ():
        name, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if name not in GOODPUT_METRICS or value <= 0:
            raise ValueError(f"--goodput takes METRIC:MS with METRIC in {GOODPUT_METRICS} and MS > 0, got {item!r}")
        slos[name] = value
    return slos


def parse_rates(ns: argparse.Namespace) -> list[float]:
    if ns.sweep is None:
        return [ns.request_rate]
    try:
        rates = [float(x) for x in ns.sweep.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes request rates separated by commas, got {ns.sweep!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--sweep rates must be > 0, got {ns.sweep!r}")
    return rates


def classes_of(n: int, share: float, seed: int) -> list[str]:
    """Which requests are high priority: round(share * n) of them, drawn with the seed (the same ones
    whatever the rate, so a fcfs and a priority run compare the same requests)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--priority-share must be in [0, 1], got {share}")
    high = set(np.random.default_rng([seed, 1]).choice(n, size=round(share * n), replace=False).tolist())
    return ["high" if i in high else "normal" for i in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each request is sent: a Poisson process (the first at 0),
    the same draws scaled for every rate; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng([seed, 2]).exponential(1.0, n)
    gaps[0] = 0.0
    return np.cumsum(gaps) / rate


def request_body(ns: argparse.Namespace, model: str, req: workloads.BenchRequest, cls: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": ns.temperature}
    if ns.endpoint == "/v1/chat/completions":
        if not isinstance(req.prompt, str):
            raise ValueError("/v1/chat/completions needs text prompts; this dataset has token ids")
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.priority_share > 0 and not ns.no_priority_field:
        body["priority"] = ns.high_priority if cls == "high" else ns.low_priority
    if ns.extra_body:
        body.update(json.loads(ns.extra_body))
    return body


def _error_message(status: int, text: str) -> str:
    try:
        err = json.loads(text).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    return f"HTTP {status}: {msg or text.strip()[:300]}"


async def send(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], cls: str,
               origin: float) -> Outcome:
    """One streamed request, timed."""
    import httpx

    o = Outcome(cls)
    chat = "messages" in body
    st = time.perf_counter()
    o.start = st - origin
    last, events = st, 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                o.error = _error_message(resp.status_code, (await resp.aread()).decode(errors="replace"))
                return o
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    o.error = _error_message(200, data)
                    return o
                if chunk.get("usage"):
                    o.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                    o.output_tokens = chunk["usage"].get("completion_tokens") or 0
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:  # a token (chat's first chunk, the role, carries no text)
                        if o.ttft is None:
                            o.ttft = now - st
                        else:
                            o.itl.append(now - last)
                        last = now
                        events += 1
        o.latency = time.perf_counter() - st
        o.output_tokens = o.output_tokens or events
        if o.ttft is None:  # no text at all: the first token is as late as the end
            o.ttft = o.latency
        o.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        o.error = f"{type(e).__name__}: {e}"
    return o


_GRPC_TOP_LEVEL = ("priority", "truncate_prompt_tokens", "cache_salt", "add_special_tokens")


def grpc_request(body: dict[str, Any]) -> Any:
    """The gRPC GenerateRequest of an HTTP completions body (jaxsched/proto/jaxsched.proto)."""
    from jaxsched.proto import jaxsched_pb2 as pb

    if "messages" in body:
        raise ValueError("--grpc sends completions (text or token ids): leave --endpoint at /v1/completions")
    if "request_id" in body:
        raise ValueError("--grpc: a request_id in --extra-body would be the same for every request; leave it out")
    sampling = {k: v for k, v in body.items() if k not in ("model", "stream", "stream_options", "prompt",
                                                           *_GRPC_TOP_LEVEL)}
    unknown = sorted(set(sampling) - set(pb.SamplingParams.DESCRIPTOR.fields_by_name))
    if unknown:
        raise ValueError(f"--grpc: no gRPC sampling_params field for {', '.join(unknown)} (see jaxsched.proto)")
    # the HTTP spellings of the fields whose proto types differ
    if isinstance(sampling.get("logit_bias"), dict):
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    so = dict(sampling.get("structured_outputs") or {})
    if isinstance(so.get("choice"), list):
        so["choice"] = {"choices": so["choice"]}
    if isinstance(so.get("json"), dict):
        so["json"] = json.dumps(so["json"])
    if so:
        sampling["structured_outputs"] = so
    prompt = body["prompt"]
    try:
        req = pb.GenerateRequest(text=prompt) if isinstance(prompt, str) else pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt))
        req.sampling_params.CopyFrom(pb.SamplingParams(**sampling))
        for k in _GRPC_TOP_LEVEL:
            if k in body:
                setattr(req, k, body[k])
    except (TypeError, ValueError) as e:  # a value the proto's types cannot hold
        raise ValueError(f"--grpc: this request does not fit jaxsched.proto's GenerateRequest: {e}") from e
    return req


async def send_grpc(stub: Any, req: Any, metadata: tuple[tuple[str, str], ...], cls: str, origin: float,
                    timeout: float) -> Outcome:
    """One Generate call, timed: a message with new tokens counts as a chunk with text does over HTTP."""
    import grpc

    o = Outcome(cls)
    st = time.perf_counter()
    o.start = st - origin
    last = st
    try:
        async for msg in stub.Generate(req, metadata=metadata, timeout=timeout):
            now = time.perf_counter()
            if any(out.token_ids for out in msg.outputs):
                if o.ttft is None:
                    o.ttft = now - st
                else:
                    o.itl.append(now - last)
                last = now
            if msg.finished:
                o.prompt_tokens, o.output_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
        o.latency = time.perf_counter() - st
        if o.ttft is None:
            o.ttft = o.latency
        o.ok = True
    except grpc.aio.AioRpcError as e:
        o.error = f"gRPC {e.code().name}: {e.details()}"
    return o


def metrics(outs: list[Outcome], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    """vLLM's serving figures of a set of requests over the benchmark's duration."""
    ok = [o for o in outs if o.ok]
    inp, out = sum(o.prompt_tokens for o in ok), sum(o.output_tokens for o in ok)
    d: dict[str, Any] = {
        "completed": len(ok), "failed": len(outs) - len(ok), "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": round(len(ok) / duration, 4), "output_throughput": round(out / duration, 3),
        "total_token_throughput": round((inp + out) / duration, 3),
    }
    if slos:
        good = sum(all({"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency}[k] * 1e3 <= v for k, v in slos.items())
                   for o in ok)
        d.update(request_goodput=round(good / duration, 4), goodput_requests=good)
    d.update(summarize([o.ttft for o in ok], "ttft"))
    d.update(summarize([o.tpot for o in ok if o.output_tokens > 1], "tpot"))
    d.update(summarize([x for o in ok for x in o.itl], "itl"))
    d.update(summarize([o.latency for o in ok], "e2el"))
    return d


async def one_rate(send_one: Any, bodies: list[Any], classes: list[str], rate: float,
                   ns: argparse.Namespace) -> tuple[list[Outcome], float, int]:
    """(outcomes in request order, duration, most requests in flight) of one run at `rate`;
    send_one(body, class, origin) sends one request."""
    arrivals = arrival_times(len(bodies), rate, ns.seed)
    sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
    in_flight = peak = 0
    origin = time.perf_counter()

    async def one(i: int) -> Outcome:
        nonlocal in_flight, peak
        await asyncio.sleep(max(0.0, origin + arrivals[i] - time.perf_counter()))
        if sem is not None:
            await sem.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await send_one(bodies[i], classes[i], origin)
        finally:
            in_flight -= 1
            if sem is not None:
                sem.release()

    outs = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    return list(outs), time.perf_counter() - origin, peak


async def served_model(client: Any, base: str, headers: dict[str, str]) -> str:
    resp = await client.get(base + "/v1/models", headers=headers)
    if resp.status_code != 200:
        raise ValueError(f"GET {base}/v1/models: {_error_message(resp.status_code, resp.text)}; pass --model")
    return resp.json()["data"][0]["id"]


def result_of(ns: argparse.Namespace, model: str, rate: float, reqs: list[workloads.BenchRequest],
              classes: list[str], outs: list[Outcome], duration: float, peak: int) -> dict[str, Any]:
    slos = parse_goodput(ns.goodput)
    res: dict[str, Any] = {
        "command": "serve", "label": ns.label,
        "backend": "grpc" if ns.grpc else "openai-chat" if "chat" in ns.endpoint else "openai",
        "base_url": ns.grpc or ns.base_url, "endpoint": "Generate" if ns.grpc else ns.endpoint, "model": model, "request_rate": rate,
        "max_concurrency": ns.max_concurrency, "num_prompts": len(outs), "duration": round(duration, 3),
        "max_concurrent_requests": peak, "workload": workloads.describe(ns, reqs),
    }
    if slos:
        res["goodput_slos_ms"] = slos
    res.update(metrics(outs, duration, slos))
    res["errors"] = dict(Counter(o.error for o in outs if not o.ok))
    res["priority"] = {"share": ns.priority_share, "high_value": ns.high_priority, "low_value": ns.low_priority,
                       "field_sent": ns.priority_share > 0 and not ns.no_priority_field}
    if ns.priority_share > 0:
        res["classes"] = {c: metrics([o for o in outs if o.cls == c], duration, slos) for c in ("high", "normal")}
    res.update(request_classes=classes, start_times=[round(o.start, 4) for o in outs],
               ttfts=[round(o.ttft, 5) if o.ok and o.ttft is not None else None for o in outs],
               e2els=[round(o.latency, 5) if o.ok else None for o in outs],
               input_lens=[o.prompt_tokens for o in outs], output_lens=[o.output_tokens for o in outs])
    return res


async def benchmark(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """One result per request rate."""
    import httpx

    rates = parse_rates(ns)
    parse_goodput(ns.goodput)  # a bad SLO fails before any request is sent
    tokenizer = None
    if ns.tokenizer:
        from jaxsched.engine.tokenizer import load_tokenizer
        from jaxsched.models.hub import resolve

        tokenizer = load_tokenizer(resolve(ns.tokenizer, field="--tokenizer"))
    reqs = workloads.build(ns, vocab_size=None, tokenizer=tokenizer)
    classes = classes_of(len(reqs), ns.priority_share, ns.seed)
    key = ns.api_key or envs.client_api_key()
    if ns.grpc:
        return await _benchmark_grpc(ns, rates, reqs, classes, key)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = ns.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(ns.timeout, connect=30.0), limits=limits) as client:
        try:
            model = ns.model or await served_model(client, base, headers)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach the server at {base} ({type(e).__name__}: {e}); check --base-url") from e
        bodies = [request_body(ns, model, r, c) for r, c in zip(reqs, classes)]

        def send_one(body: dict[str, Any], cls: str, origin: float) -> Any:
            return send(client, base + ns.endpoint, body, headers, cls, origin)

        return await _runs(ns, rates, send_one, bodies, classes, reqs, model, f"{base}{ns.endpoint}")


async def _benchmark_grpc(ns: argparse.Namespace, rates: list[float], reqs: list[workloads.BenchRequest],
                          classes: list[str], key: str | None) -> list[dict[str, Any]]:
    import grpc

    from jaxsched.proto import jaxsched_pb2 as pb
    from jaxsched.proto import jaxsched_pb2_grpc as pb_grpc

    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with grpc.aio.insecure_channel(ns.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            model = (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)).served_model_name
        except grpc.aio.AioRpcError as e:
            raise ValueError(f"cannot reach the gRPC server at {ns.grpc} ({e.code().name}: {e.details()}); check "
                             "--grpc") from e
        calls = [grpc_request(request_body(ns, model, r, c)) for r, c in zip(reqs, classes)]

        def send_one(req: Any, cls: str, origin: float) -> Any:
            return send_grpc(stub, req, metadata, cls, origin, ns.timeout)

        return await _runs(ns, rates, send_one, calls, classes, reqs, model, f"gRPC {ns.grpc}")


async def _runs(ns: argparse.Namespace, rates: list[float], send_one: Any, bodies: list[Any], classes: list[str],
                reqs: list[workloads.BenchRequest], model: str, where: str) -> list[dict[str, Any]]:
    for _ in range(ns.num_warmups):  # also the check that the server takes these requests at all
        o = await send_one(bodies[0], classes[0], time.perf_counter())
        if not o.ok:
            raise ValueError(f"the warm-up request to {where} failed: {o.error}")
    results = []
    for rate in rates:
        logger.info("%d requests at %s requests/s to %s", len(bodies), rate, where)
        outs, duration, peak = await one_rate(send_one, bodies, classes, rate, ns)
        results.append(result_of(ns, model, rate, reqs, classes, outs, duration, peak))
    return results


def summary_line(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in PER_REQUEST}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_summary(res: dict[str, Any]) -> None:
    print(f"rate {res['request_rate']} req/s: {res['completed']} completed, {res['failed']} failed in "
          f"{res['duration']:.2f} s; {res['request_throughput']:.2f} req/s, {res['output_throughput']:.1f} output "
          f"tok/s, {res['total_token_throughput']:.1f} total tok/s")
    rows = [("all", res)] + list(res.get("classes", {}).items())
    print(f"  {'class':<8}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}{'TPOT mean':>11}{'ITL mean':>10}"
          f"{'E2E mean':>10}{'p99':>9}  (ms)")
    for name, m in rows:
        print(f"  {name:<8}{_ms(m['mean_ttft_ms']):>10}{_ms(m['median_ttft_ms']):>8}{_ms(m['p90_ttft_ms']):>8}"
              f"{_ms(m['p99_ttft_ms']):>8}{_ms(m['mean_tpot_ms']):>11}{_ms(m['mean_itl_ms']):>10}"
              f"{_ms(m['mean_e2el_ms']):>10}{_ms(m['p99_e2el_ms']):>9}")
    if "request_goodput" in res:
        print(f"  goodput {res['request_goodput']:.2f} req/s ({res['goodput_requests']} requests within the SLOs)")
    for msg, n in res["errors"].items():
        print(f"  error x{n}: {msg}")


def main(ns: argparse.Namespace) -> int:
    if ns.plot:
        from jaxsched.bench.plots import require_matplotlib

        require_matplotlib()
    compared = [json.loads(Path(f).read_text()) for f in ns.compare]  # read before the run: a bad path fails now
    results = asyncio.run(benchmark(ns))
    for res in results:
        print_summary(res)
    if ns.plot:
        from jaxsched.bench import plots

        for res in results:
            for path in plots.serve_cdf(res, compared, ns.plot, suffix=len(results) > 1):
                print(f"plot       {path}")
        if len(results) > 1:
            for path in plots.serve_sweep(results, ns.plot):
                print(f"plot       {path}")
    if ns.sweep is None:
        emit(results[0], ns, [summary_line(results[0])])
    else:
        emit({"command": "serve", "label": ns.label, "sweep": results}, ns, [summary_line(r) for r in results])
    return 0
