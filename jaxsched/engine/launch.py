"""Starting an engine's cores: the client that EngineArgs ask for (core_client.py lists the kinds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxsched.config import EngineArgs
from jaxsched.engine.core import EngineCore
from jaxsched.engine.core_client import EngineCoreClient, InprocClient, LoopClient, Outbox, ThreadClient
from jaxsched.engine.core_process import ProcessClient
from jaxsched.parallel.data_parallel import DataParallelClient, data_parallel_cores
from jaxsched.parallel.multihost import MultiHostClient


def make_client(args: EngineArgs, devices: Sequence[Any] | None = None, own_loop: bool = False) -> EngineCoreClient:
    """The client EngineArgs ask for. One core: stepped by the caller (InprocClient), or with
    own_loop on a thread of its own; engine_core_process (None: the platform's choice, taken by
    the caller: serving/cli.py) puts each core in a process of its own. data_parallel_size > 1:
    that many cores, each with its own loop. distributed_coordinator: this host's core of an
    engine over several hosts."""
    if args.distributed_coordinator is not None:
        return MultiHostClient(args)
    if args.engine_core_process:
        if devices is not None:
            raise ValueError("engine_core_process=True picks its devices in the core's own process: pass no devices")
        outbox = Outbox()
        clients: list[LoopClient] = [ProcessClient(args, 0, outbox)]
        if args.data_parallel_size == 1:
            return clients[0]
        blocks = clients[0].config.cache.num_blocks
        rest = dataclasses.replace(args, num_gpu_blocks_override=blocks)
        clients += [ProcessClient(rest, i, outbox) for i in range(1, args.data_parallel_size)]
        return DataParallelClient(clients, outbox)
    if args.data_parallel_size > 1:
        outbox = Outbox()
        return DataParallelClient([ThreadClient(c, outbox) for c in data_parallel_cores(args, devices)], outbox)
    core = EngineCore(args, devices=devices)
    return ThreadClient(core) if own_loop else InprocClient(core)
