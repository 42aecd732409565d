"""WriteLock: taken by a call when free, handed over in arrival order, never lost to a cancel."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.actors.write_lock import WriteLock


async def test_a_free_lock_is_taken_by_a_call_and_a_held_one_is_not() -> None:
    lock = WriteLock()
    assert lock.try_acquire() and lock.locked()
    assert not lock.try_acquire()
    lock.release()
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


async def test_waiters_get_the_lock_in_arrival_order_and_no_newcomer_barges_in() -> None:
    lock = WriteLock()
    lock.try_acquire()
    order: list[int] = []

    async def take(n: int) -> None:
        async with lock:
            order.append(n)
            await asyncio.sleep(0)

    tasks = [asyncio.ensure_future(take(n)) for n in range(3)]
    await anyio.wait_all_tasks_blocked()  # all three wait
    assert len(lock._waiters or ()) == 3
    lock.release()
    assert lock.locked() and not lock.try_acquire()  # handed to the first waiter already
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and not lock.locked()


async def test_a_waiter_cancelled_after_the_hand_over_passes_the_lock_on() -> None:
    lock = WriteLock()
    lock.try_acquire()
    first = asyncio.ensure_future(lock.acquire())
    second = asyncio.ensure_future(lock.acquire())
    await anyio.wait_all_tasks_blocked()  # both wait
    lock.release()  # now the first's ...
    first.cancel()  # ... but it is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await second  # so the second has it
    assert lock.locked()
    lock.release()
    assert not lock.locked() and lock.try_acquire()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=12))
def test_mutual_exclusion_holds_whoever_is_cancelled_while_waiting(
    plan: list[tuple[int, bool]],
) -> None:
    async def run() -> None:
        lock = WriteLock()
        inside = 0
        finished = 0

        async def worker(yields: int) -> None:
            nonlocal inside, finished
            async with lock:
                inside += 1
                assert inside == 1
                for _ in range(yields):
                    await asyncio.sleep(0)
                inside -= 1
            finished += 1

        tasks = [asyncio.ensure_future(worker(y)) for y, _ in plan]
        # One loop pass, not a wait for anything: the first worker holds the lock, the
        # others queue, and the cancels below land among them wherever they are.
        await asyncio.sleep(0)
        for task, (_, cancel) in zip(tasks, plan, strict=True):
            if cancel:
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        done = sum(not isinstance(r, BaseException) for r in results)
        assert finished == done and not lock.locked() and lock.try_acquire()

    asyncio.run(run())
