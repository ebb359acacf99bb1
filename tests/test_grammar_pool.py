"""serving/grammar_pool.py: grammar compiles shared by client in turn; a compile past its time limit
keeps its thread but not the others' capacity, and its client waits for it to end."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serving.grammar_pool import GrammarBusyError, GrammarPool


def test_clients_take_turns_so_a_flood_does_not_starve_another_client():
    pool = GrammarPool(workers=1)
    order: list[str] = []

    def job(name: str, seconds: float = 0.05):
        def run():
            time.sleep(seconds)
            order.append(name)
            return name
        return run

    async def main():
        flood = [asyncio.create_task(pool.run("hostile", job(f"h{i}"), 30)) for i in range(6)]
        await asyncio.sleep(0.01)  # the flood is queued first
        mine = await pool.run("other", job("mine"), 30)
        await asyncio.gather(*flood)
        return mine

    assert asyncio.run(main()) == "mine"
    assert order.index("mine") <= 2, order  # after at most the flood's job running and one more


def test_a_compile_past_its_limit_keeps_the_others_capacity_and_blocks_its_client():
    pool = GrammarPool(workers=1, max_stuck=2)
    release = threading.Event()

    async def main():
        with pytest.raises(TimeoutError):
            await pool.run("hostile", lambda: release.wait(30), timeout=0.2)
        assert pool.stuck == 1
        with pytest.raises(GrammarBusyError, match="still compiling past the time limit"):
            await pool.run("hostile", lambda: "again", timeout=5)
        t0 = time.monotonic()
        assert await pool.run("other", lambda: "fine", timeout=5) == "fine"  # a thread took the stuck one's place
        took = time.monotonic() - t0
        release.set()
        for _ in range(100):
            if pool.stuck == 0:
                break
            await asyncio.sleep(0.02)
        assert pool.stuck == 0
        assert await pool.run("hostile", lambda: "later", timeout=5) == "later"  # its compile ended: served again
        return took

    assert asyncio.run(main()) < 1.0


def test_a_job_that_times_out_before_it_starts_is_dropped():
    pool = GrammarPool(workers=1)
    ran: list[str] = []
    gate = threading.Event()

    async def main():
        first = asyncio.create_task(pool.run("a", lambda: gate.wait(5), timeout=10))
        await asyncio.sleep(0.05)
        with pytest.raises(TimeoutError):
            await pool.run("b", lambda: ran.append("b"), timeout=0.1)  # still queued behind "a"
        gate.set()
        await first
        await asyncio.sleep(0.1)
        assert pool.stuck == 0

    asyncio.run(main())
    assert ran == []
