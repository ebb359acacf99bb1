"""What an engine over several hosts needs before its core exists: the jax.distributed cluster, and
one KV pool size for every host. No engine imports here (the core calls this while it builds)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxsched.config import EngineArgs, EngineConfig

logger = logging.getLogger(__name__)


def initialize(args: EngineArgs) -> None:
    """jax.distributed.initialize from the engine arguments (before anything touches a device)."""
    import jax

    if jax.distributed.is_initialized():
        return
    if args.distributed_coordinator == "auto":  # Slurm, Open MPI, Kubernetes, ... (JAX's detection)
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(args.distributed_coordinator, args.num_processes, args.process_id)
    logger.info("process %d of %d; %d local and %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def same_pool_on_every_host(cfg: EngineConfig) -> EngineConfig:
    """The config with the smallest KV and swap pools any process sized from its own memory: every
    host must allocate the same global pool and schedule against the same block count."""
    from jax.experimental import multihost_utils

    mine = np.array([cfg.cache.num_blocks, cfg.scheduler.num_host_blocks], np.int64)
    least = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2).min(axis=0)
    if (least == mine).all():
        return cfg
    logger.info("KV pool: %d blocks (the smallest any host has room for; this one had %d)", least[0], mine[0])
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_blocks=int(least[0])),
                               scheduler=dataclasses.replace(cfg.scheduler, num_host_blocks=int(least[1])))
