"""Every environment variable jaxsched reads, in one place (as vLLM's envs.py): its name, what it
does, and its parsed value. Each is read when asked, not at import, so that a test or a parent
process may set it before the engine starts. Settings an engine is built from are EngineArgs, not
variables: what is here chooses process state that must be fixed before jax starts, where files
go, and the suite's checks."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# where compiled programs, the demo model and converted tokenizers are kept (cache_dir)
CACHE = "JAXSCHED_CACHE"
# glibc's malloc: auto (keep freed memory when jax runs on the CPU), keep, or system (leave glibc
# alone: an embedding application's opt-out). platforms/host_malloc.py
HOST_MALLOC = "JAXSCHED_HOST_MALLOC"
HOST_MALLOC_CHOICES = ("auto", "keep", "system")
# anything but 0: check every steady step's packing against packing it in full (runner/batch.py)
VERIFY_PACK = "JAXSCHED_VERIFY_PACK"
# anything but 0: check the incremental detokenizer against the window, token by token
# (engine/detokenizer.py)
VERIFY_DETOK = "JAXSCHED_VERIFY_DETOK"
# the server's bearer key when --api-key is not given (serving/cli.py)
API_KEY = "JAXSCHED_API_KEY"
# what jax will run on, read before it starts (platforms.expected)
JAX_PLATFORMS = ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")
# XLA's CPU client sizes its thread pools from these, in this order (platforms/cpu_affinity.py)
XLA_POOL_SIZE = ("PJRT_NPROC", "NPROC")
# 1 / true / yes / on: a Hub model id is looked up in the Hugging Face cache only, never downloaded
# (models/hub.py); huggingface_hub reads HF_TOKEN, HF_HOME and HF_HUB_CACHE itself
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def cache_dir() -> Path:
    """$JAXSCHED_CACHE, else $XDG_CACHE_HOME/jaxsched, else ~/.cache/jaxsched."""
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxsched"


def host_malloc(environ: Mapping[str, str] | None = None) -> str:
    """JAXSCHED_HOST_MALLOC, one of HOST_MALLOC_CHOICES (default auto); `environ` for a test's."""
    environ = os.environ if environ is None else environ
    choice = environ.get(HOST_MALLOC, "auto").strip().lower() or "auto"
    if choice not in HOST_MALLOC_CHOICES:
        raise ValueError(f"{HOST_MALLOC}={environ[HOST_MALLOC]!r} is not one of {', '.join(HOST_MALLOC_CHOICES)}: "
                         "keep sets glibc's malloc up to keep freed memory (in one arena), system leaves it alone, "
                         "auto keeps it when jax runs on the CPU and lets an engine with small programs give "
                         "threads arenas of their own")
    return choice


def hf_hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (TRANSFORMERS_OFFLINE too), read when asked: the
    library reads it once, at its import."""
    value = os.environ.get(HF_HUB_OFFLINE) or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def verify_pack() -> bool:
    return _flag(VERIFY_PACK)


def verify_detok() -> bool:
    return _flag(VERIFY_DETOK)


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def client_api_key() -> str | None:
    """The key a benchmark client sends: OpenAI's clients' variable, else the server's own."""
    return os.environ.get("OPENAI_API_KEY") or api_key()


def jax_platforms(environ: Mapping[str, str] | None = None) -> str:
    """JAX_PLATFORMS (or the older JAX_PLATFORM_NAME), lower case; "" when neither is set."""
    environ = os.environ if environ is None else environ
    return environ.get(JAX_PLATFORMS[0], environ.get(JAX_PLATFORMS[1], "")).strip().lower()


def narrow_visible_devices(name: str, index: int, count: int) -> None:
    """Before jax starts: let this process see only devices [index * count, (index + 1) * count)
    of those visible to it, through the platform's visible-devices variable `name`
    (CUDA_VISIBLE_DEVICES: platforms/platform.py) - a data-parallel core process's own group."""
    lo = index * count
    visible = os.environ.get(name)
    ids = visible.split(",") if visible else [str(i) for i in range(lo + count)]
    os.environ[name] = ",".join(ids[lo:lo + count])


def xla_pool_size_set() -> bool:
    """Whether the user sized XLA's CPU thread pools (then the engine leaves them as asked)."""
    return any(v in os.environ for v in XLA_POOL_SIZE)
