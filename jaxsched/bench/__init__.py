"""`jaxsched bench`: benchmarks, as vLLM's `vllm bench`, each writing a JSON result (and PNG plots
with --plot).

  jaxsched bench throughput [MODEL] [engine flags]   offline: continuous vs static batching, overlap on / off
  jaxsched bench serve --base-url URL                a client of any OpenAI-compatible server: TTFT, TPOT, ITL
  jaxsched bench latency [MODEL] [engine flags]      one batch, prefill and decode time per step
  jaxsched bench scheduler                           the scheduler alone at R = 256 ... 4096 requests

serving/cli.py installs these with add_arguments(parser) and runs them with run(ns);
`python -m jaxsched.bench ...` does the same without the rest of the CLI.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "throughput": "offline throughput of a workload: continuous vs static batching, overlap on / off",
    "serve": "a client of an OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency, per priority class",
    "latency": "one batch of requests: prefill and decode time per step",
    "scheduler": "the scheduler alone (no model): per-step time at R = 256 ... 4096 requests",
}


def _module(name: str):
    return importlib.import_module(f"jaxsched.bench.{name}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Install the bench commands as sub-commands of `parser` (dest: bench_command)."""
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        mod = _module(name)
        p = sub.add_parser(name, help=help_text, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)


def run(ns: argparse.Namespace) -> int:
    """Run the bench command `ns` names (ValueError on bad settings, as the rest of the CLI)."""
    return _module(ns.bench_command).main(ns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxsched bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO")
    add_arguments(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        return run(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
