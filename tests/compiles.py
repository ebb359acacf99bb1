"""A context manager that fails the test if jax compiles anything inside it."""

from __future__ import annotations

import contextlib

import jax.monitoring


@contextlib.contextmanager
def no_compilation():
    """Counts jax's compile events in the block; asserts there were none (every shape a step can
    have, swaps, copies and penalty tables included, is compiled at warm-up)."""
    compiles: list[str] = []

    def on_event(name: str, *args, **kwargs) -> None:
        if name.startswith("/jax/core/compile/"):
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == [], f"{len(compiles)} compilation events after warm-up"
