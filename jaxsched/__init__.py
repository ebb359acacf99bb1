"""jaxsched: an LLM serving engine on JAX. Public API mirrors vLLM's.

Names are imported lazily so that host-only modules (scheduler, block manager) load without jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "jaxsched.engine.llm",
    "LLMEngine": "jaxsched.engine.llm_engine",
    "EngineArgs": "jaxsched.config",
    "SamplingParams": "jaxsched.core.request",
    "RequestOutputKind": "jaxsched.core.request",
    "RequestOutput": "jaxsched.engine.outputs",
    "CompletionOutput": "jaxsched.engine.outputs",
    "Logprob": "jaxsched.engine.outputs",
}
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput", "RequestOutputKind",
           "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxsched' has no attribute {name!r}")
