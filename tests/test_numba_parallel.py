"""numba_parallel: the CPU kernels' parallel regions run on XLA's threads while a Python thread
holds the GIL, which is what lets the device compute a step while the engine schedules the next
one (overlapped scheduling) and while the server's event loop runs."""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import make_case

from pallas_kernels import numba_matmul, numba_parallel, paged_attention
from pallas_kernels.numba_attention import rope_write_kv
from pallas_kernels.numba_kv_write import SERIAL_TOKENS


def _hold_the_gil(seconds: float) -> None:
    """Run Python, and nothing that lets the GIL go, for `seconds` (the caller has raised the
    switch interval, so no waiting thread can take it either)."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


@pytest.fixture
def gil_kept_by_its_holder():
    """While in the test, a thread that holds the GIL keeps it until it blocks (a 100 s switch
    interval instead of 5 ms): a kernel that needs the GIL cannot get it from a spinning thread."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    yield
    sys.setswitchinterval(old)


def _step(rounds, x, wp, q, k, v, cos, sin, k_cache, v_cache, slots, bt, seq_lens, qsl, num_seqs):
    """Each kind of parallel region of the "numba" backend's step, `rounds` times in a loop: a
    packed matmul, rope and the KV write (parallel above SERIAL_TOKENS tokens), attention. The loop
    is what makes XLA run the program on its own threads, as the engine's layer loop does (a
    program without one runs inline, on the thread that calls it)."""

    def body(_, acc):
        y = numba_matmul.matmul(x, wp)
        q2, kc, vc = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, jnp.int32(0), slots)
        att = paged_attention(q2[: bt.shape[0]], kc, vc, jnp.int32(0), bt, seq_lens, qsl, num_seqs,
                              sm_scale=0.125, backend="numba")
        return acc[0] + y, acc[1] + att

    init = (jnp.zeros((x.shape[0], wp.shape[0] * wp.shape[2]), jnp.float32),
            jnp.zeros((bt.shape[0], *q.shape[1:]), jnp.float32))
    return jax.lax.fori_loop(0, rounds, body, init)


def test_kernels_run_while_a_python_thread_holds_the_gil(gil_kept_by_its_holder):
    assert numba_parallel.install()  # the kernels' modules installed it at import: a no-op here
    rng = np.random.default_rng(0)
    T, N, K, H, P = 2 * SERIAL_TOKENS, 4, 2, 64, 16
    x = jnp.asarray(rng.standard_normal((T, 64)), jnp.float32)
    wp = jnp.asarray(numba_matmul.pack(rng.standard_normal((64, 64)).astype(np.float32)))
    q_lens = [1] * 8
    case = make_case(rng, q_lens, [40] * 8, N=N, K=K, H=H, P=P, S=8, T=8, NB=64, L=1, M=8)
    _, k_pool, v_pool, bt, seq_lens, qsl, num_seqs = case
    k_pool = jnp.swapaxes(k_pool, -1, -2)  # the numba backend's K pages are [H, P]
    q, k, v = (jnp.asarray(rng.standard_normal((T, n, H)), jnp.float32) for n in (N, K, K))
    cos = jnp.asarray(rng.standard_normal((T, H // 2)), jnp.float32)
    sin = jnp.asarray(rng.standard_normal((T, H // 2)), jnp.float32)
    slots = jnp.arange(T, dtype=jnp.int32) + P  # block 1 onwards: past the null page
    step = jax.jit(_step)
    args = (jnp.int32(2), x, wp, q, k, v, cos, sin, k_pool, v_pool, slots, bt, seq_lens, qsl, num_seqs)
    ref = jax.block_until_ready(step(*args))  # compiled, and its kernels loaded, before the real call
    out = step(*args)  # dispatched: XLA's threads run it
    _hold_the_gil(2.0)  # a few milliseconds of work, given 2 s; numba's own regions waited for the GIL
    ready = all(a.is_ready() for a in out)
    jax.block_until_ready(out)
    assert ready, "the step did not finish while this thread held the GIL: a parallel region waited for it"
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_caller_that_holds_the_gil_still_lets_it_go_during_a_region():
    """Called from Python (the GIL held), a region still releases the GIL while it runs, as numba
    does: another Python thread makes progress meanwhile."""
    import threading

    from numba import njit, prange

    @njit(parallel=True)
    def spin(n):  # a few hundred ms of arithmetic on every thread
        acc = np.zeros(4)
        for t in prange(4):
            s = 0.0
            for i in range(n):
                s += (i % 7) * 1e-9
            acc[t] = s
        return acc

    spin(10)  # compiled
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=count)
    t0 = time.perf_counter()
    th.start()
    spin(300_000_000)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    during = [t for t in ticks if t0 + 0.05 < t < t1 - 0.05]
    assert t1 - t0 > 0.2, "the region was too short to tell"
    assert len(during) >= 10, f"the other thread ran {len(during)} times in {t1 - t0:.2f} s of the region"
