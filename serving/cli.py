"""The `jaxsched` command line.

  jaxsched serve [MODEL] [--host H --port P] [--grpc-port G] [engine flags]  the OpenAI-compatible HTTP
                                                            server (and gRPC, jaxsched/proto/jaxsched.proto)
  jaxsched generate [MODEL] --prompt "..." [engine flags]   offline generation (chat template by default)
  jaxsched run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [engine flags]  an OpenAI batch file, offline
  jaxsched bench throughput | serve | latency | scheduler [flags]    benchmarks: JSON results, --plot PNGs

Engine flags carry vLLM's names (--max-model-len, --max-num-seqs, ...); no MODEL means the demo model.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time

from jaxsched import bench as bench_cmd
from jaxsched import envs
from jaxsched.engine_flags import add_engine_flags, engine_args_from
from serving import run_batch
from serving.chat_tools import DEFAULT_TOOL_PARSER
from serving.reasoning import REASONING_PARSERS
from serving.server import DEFAULT_SHUTDOWN_TIMEOUT
from serving.tool_calls import PARSERS


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxsched import LLM, SamplingParams

    llm = LLM.from_engine_args(engine_args_from(ns))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
                            seed=ns.sampling_seed)
    prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    t0 = time.perf_counter()
    if ns.no_chat:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    if not llm.llm_engine.is_leader:  # another host of a multi-host engine: process 0 prints
        return 0
    for p, o in zip(prompts, outs):
        print(f">>> {p}\n{o.outputs[0].text}\n")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[{n} tokens in {dt:.2f} s; warm-up {llm.llm_engine.info.warmup_seconds:.1f} s]", file=sys.stderr)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from jaxsched.core.buckets import bucket_pairs
    from jaxsched.engine.llm_engine import create_engine
    from serving.app import allowed_hosts_for, build_app
    from serving.async_engine import AsyncEngine
    from serving.server import freeze_heap, serve

    log = logging.getLogger("jaxsched.serve")
    if ns.grpc_port is not None and not 0 <= ns.grpc_port < 65536:
        raise ValueError(f"--grpc-port must be a port number in [0, 65535], got {ns.grpc_port}")
    if ns.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {ns.shutdown_timeout}")
    args = engine_args_from(ns)
    if args.warm_up_runs is None:  # a server's first burst of requests must not pay first-run costs
        args = dataclasses.replace(args, warm_up_runs=True)
    if args.engine_core_process is None and args.distributed_coordinator is None:
        args = dataclasses.replace(args, engine_core_process=serve_core_process_default())
    eng = create_engine(args)
    if not eng.is_leader:  # a multi-host engine's other hosts run process 0's steps
        log.info("process %d follows process 0 (which serves HTTP) until it shuts down", eng.client.process_id)
        _stop_with_the_leader(log)
        eng.follow()
        return 0
    name = ns.served_model_name or ns.model or "demo"
    sc, cc = eng.scheduler_config, eng.cache_config
    pairs = bucket_pairs(sc.token_buckets, sc.seq_buckets)
    log.info("serving %s as %r on http://%s:%d | KV pool %d blocks x %d = %d tokens, %.1f MiB per device, "
             "tensor parallel %d x data parallel %d, engine core%s in %s | %d bucket pairs compiled (T in %s, "
             "S in %s) | warm-up %.1f s", eng.config.model_path, name, ns.host, ns.port, cc.num_usable_blocks,
             cc.block_size, cc.num_usable_blocks * cc.block_size, eng.kv_bytes_per_device() / 2**20,
             args.tensor_parallel_size, args.data_parallel_size, "s" if args.data_parallel_size > 1 else "",
             "processes of their own" if args.engine_core_process else "this process", len(pairs),
             list(sc.token_buckets), list(sc.seq_buckets), eng.info.warmup_seconds)
    engine = AsyncEngine(eng, queue_timeout=ns.queue_timeout)  # max_num_queued_requests is one of the EngineArgs
    api_key = ns.api_key or envs.api_key() or None
    hosts = allowed_hosts_for(ns.host, ns.allowed_hosts.split(",") if ns.allowed_hosts else None)
    app = build_app(engine, served_model_name=name, api_key=api_key, max_request_bytes=ns.max_request_bytes,
                    trust_request_chat_template=ns.trust_request_chat_template, tool_call_parser=ns.tool_call_parser,
                    allowed_hosts=hosts, expose_model_path=ns.expose_model_path, reasoning_parser=ns.reasoning_parser)
    front_ends = ()
    if ns.grpc_port is not None:
        from serving.grpc_server import GrpcFrontEnd

        front_ends = (GrpcFrontEnd(app, ns.grpc_port, ns.host, api_key),)
    # a multi-host engine's leader tells the other processes to stop, however this process ends,
    # once its engine core has finished its last step
    on_exit = None
    if args.distributed_coordinator is not None:
        def on_exit() -> None:
            engine.shutdown(timeout=None)
            eng.shutdown()
    freeze_heap()  # everything built so far lives as long as the server
    try:
        code = serve(app, engine, ns.host, ns.port, shutdown_timeout=ns.shutdown_timeout,
                     log_level=ns.log_level.lower(), on_exit=on_exit, front_ends=front_ends)
    finally:
        engine.shutdown()
        eng.shutdown()
    return code


def serve_core_process_default() -> bool:
    """Where `jaxsched serve` runs its engine cores when engine_core_process is not given: in
    processes of their own, on every platform: the step loop no longer shares the server's GIL,
    which pays where steps are long enough for the model to want the cores, and costs a little on a
    tiny host-bound model (docs/PERFORMANCE.md, "Served"). On a GPU, whose steps the host bounds,
    the same holds with more cores to spare (not measured yet)."""
    return True


def _stop_with_the_leader(log: logging.Logger) -> None:
    """A follower outlives the first SIGTERM / SIGINT: a cluster manager signals every host at once,
    and process 0 still drains its requests, whose steps need this process. It stops when process
    0 publishes "stop" (or is gone); a second signal stops it at once."""
    def first(signum: int, frame: object) -> None:
        log.warning("%s: waiting for process 0 to stop (send it again to stop now)", signal.Signals(signum).name)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxsched", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for prompts given as flags or on stdin")
    gen.add_argument("model", nargs="?", default=None, help="a Hugging Face model folder, .gguf file or Hub id such as "
                     "Qwen/Qwen3-0.6B (default: the demo model)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several (default: read stdin)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_flags(gen)
    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    srv.add_argument("model", nargs="?", default=None, help="a Hugging Face model folder, .gguf file or Hub id such as "
                     "Qwen/Qwen3-0.6B (default: the demo model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=None,
                     help="also serve gRPC (jaxsched/proto/jaxsched.proto: token ids in and out) on this port, on "
                          "the same engine and --host (default: off)")
    srv.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: MODEL)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXSCHED_API_KEY, else none)")
    srv.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="larger bodies get HTTP 413")
    srv.add_argument("--queue-timeout", type=float, default=None,
                     help="seconds a request may wait in the queue without starting; then it gets HTTP 503 with "
                          "Retry-After (an error event in a stream) and is counted in jaxsched:request_timeouts_total "
                          "(default: no limit). A request's own limit is its `timeout` field")
    srv.add_argument("--allowed-hosts", default=None,
                     help="comma-separated Host header names the server answers, any port ('*': any name); the "
                          "default for a server bound to 127.0.0.1, ::1 or localhost is localhost,127.0.0.1,[::1] "
                          "(a web page's DNS rebinding cannot reach it), for other binds any")
    srv.add_argument("--expose-model-path", action="store_true",
                     help="show the model's path on disk as /v1/models' root (default: the served name)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept chat templates sent in requests (chat_template, chat_template_kwargs.chat_template); "
                          "a template is code the server runs, so by default they get HTTP 400")
    srv.add_argument("--tool-call-parser", default=DEFAULT_TOOL_PARSER, choices=sorted(PARSERS),
                     help="how tool calls are read out of the model's text for tool_choice 'auto' (default: "
                          "%(default)s, the <tool_call>{json}</tool_call> format of Hermes, Qwen and SmolLM3 models; "
                          "llama3_json: Llama 3's JSON format; mistral: [TOOL_CALLS] and a JSON list, or v11's "
                          "name[ARGS]{...}; pythonic: [f(a=1), g()] as Llama 3.2 and 4 write)")
    srv.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                     help="separate reasoning models' thinking (<think>...</think>) into reasoning_content: qwen3 "
                          "(the model opens <think> itself) or deepseek_r1 (the chat template opens it); default: "
                          "none, the thinking stays in content")
    srv.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                     help="seconds requests in flight get to finish after SIGTERM / SIGINT before they are failed "
                          "and the server exits (default: %(default)s)")
    add_engine_flags(srv)
    rb = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline, one result line per request")
    run_batch.add_arguments(rb)
    add_engine_flags(rb)
    bench = sub.add_parser("bench", help="benchmarks (as vllm bench): throughput, serve, latency, scheduler",
                           description=bench_cmd.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_cmd.add_arguments(bench)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "run-batch":
            return run_batch.cmd_run_batch(ns, engine_args_from(ns))
        if ns.command == "bench":
            return bench_cmd.run(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
