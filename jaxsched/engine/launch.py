"""Starting an engine's cores: the client that EngineArgs ask for (core_client.py lists the kinds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxsched.config import EngineArgs
from jaxsched.engine.core import EngineCore
from jaxsched.engine.core_client import EngineCoreClient, InprocClient, Outbox, ThreadClient
from jaxsched.engine.core_process import ProcessClient
from jaxsched.models.hub import local_args
from jaxsched.parallel.data_parallel import DataParallelClient, data_parallel_cores, start_cores
from jaxsched.parallel.multihost import MultiHostClient


def make_client(args: EngineArgs, devices: Sequence[Any] | None = None, own_loop: bool = False) -> EngineCoreClient:
    """The client EngineArgs ask for. One core: stepped by the caller (InprocClient), or with
    own_loop on a thread of its own; engine_core_process (None: the platform's choice, taken by
    the caller: serving/cli.py) puts each core in a process of its own. data_parallel_size > 1:
    that many cores, each with its own loop. distributed_coordinator: this host's core of an
    engine over several hosts."""
    args = local_args(args)  # a Hub id downloaded (or found in the cache) once, before any core starts
    if args.distributed_coordinator is not None:
        return MultiHostClient(args)
    if args.engine_core_process:
        if devices is not None:
            raise ValueError("engine_core_process=True picks its devices in the core's own process: pass no devices")
        outbox = Outbox()
        if args.data_parallel_size == 1:
            return ProcessClient(args, 0, outbox)
        return DataParallelClient(start_cores(args, lambda one, i: ProcessClient(one, i, outbox)), outbox)
    if args.data_parallel_size > 1:
        outbox = Outbox()
        return DataParallelClient([ThreadClient(c, outbox) for c in data_parallel_cores(args, devices)], outbox)
    core = EngineCore(args, devices=devices)
    return ThreadClient(core) if own_loop else InprocClient(core)
