"""The runtime's one timer: fires the schedules that come due (``Runtime.schedule``).

Schedules live in the store (:mod:`torpor.store.schedules`), never one task or one
object per schedule here: one task, :class:`Scheduler`, reads what is due from the
store's due index, hands each to the conversation's actor (which logs the scheduled
message and moves the schedule in one transaction: exactly once), then asks the
store for the next due time and sleeps until then. A new schedule that comes due
sooner wakes it (:meth:`Scheduler.poke`), as does a node gaining shards. It also
wakes at least every ``MAX_SLEEP`` seconds (a clock that jumped, a schedule another
process added to this database), which costs one indexed read, not one per schedule.

What is overdue when it starts (the runtime was down, the node took the shard over)
fires at once; a repeating schedule that missed several intervals fires once, then
at the first of its times still ahead (:func:`torpor.store.schedules.next_due`).

A firing that fails for a reason that passes (the store cannot write, the mailbox
is full, the shard is moving) is tried again after a backoff, per schedule; one
whose conversation is parked or gone is dropped (the schedule removed) and logged.
At most ``concurrency`` firings are in flight; each ends once its message is logged,
not when its turn does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from torpor.errors import (
    AgentParked,
    NotOwner,
    RuntimeClosed,
    ScheduleGone,
    UnknownConversation,
)
from torpor.store.protocol import EventStore
from torpor.store.schedules import Firing, Schedule, next_due

__all__ = ["MAX_SLEEP", "Scheduler"]

MAX_SLEEP = 30.0  # seconds the timer sleeps at most (see the module docstring)
PAGE = 500  # due schedules read at a time
_RETRY_FIRST = 0.25
_RETRY_MAX = 10.0

Clock = Callable[[], float]


class Firer(Protocol):
    """What the timer needs of the runtime."""

    @property
    def store(self) -> EventStore: ...

    def schedule_shards(self) -> tuple[Sequence[int], int] | None:
        """On a cluster node: (the shards whose schedules it fires, the shard count)."""
        ...

    def fire(self, schedule: Schedule, firing: Firing) -> Coroutine[Any, Any, None]:
        """Have the conversation's actor log the scheduled message with ``firing``."""
        ...


class Scheduler:
    __slots__ = (
        "_clock", "_concurrency", "_firer", "_firing", "_log", "_retry", "_slots", "_target",
        "_task", "_wake", "fired",
    )

    def __init__(self, firer: Firer, *, clock: Clock, log: Any, concurrency: int = 256) -> None:
        self._firer = firer
        self._clock = clock
        self._log = log
        self._concurrency = concurrency
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._firing: dict[str, asyncio.Task[None]] = {}  # schedule id -> its firing
        self._retry: dict[str, tuple[float, float]] = {}  # id -> (not before, next delay)
        self._slots: asyncio.Semaphore | None = None
        self._target: int | None = None  # epoch ms the timer sleeps until (None: awake)
        self.fired = 0  # firings logged by this runtime

    def now(self) -> int:
        """Epoch ms by the runtime's clock."""
        return int(self._clock() * 1000)

    def start(self) -> None:
        self._slots = asyncio.Semaphore(self._concurrency)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="torpor-scheduler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        firing = list(self._firing.values())
        for each in (task, *firing):
            if each is not None:
                each.cancel()
        for each in (task, *firing):
            if each is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await each

    def poke(self, due: int | None = None) -> None:
        """A schedule due at ``due`` (epoch ms) was added, or (None) the shards changed:
        wake the timer unless it sleeps until then anyway."""
        target = self._target
        if due is None or target is None or due < target:
            self._wake.set()

    # -- the timer ------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = _RETRY_FIRST
        while True:
            self._wake.clear()
            self._target = None
            try:
                full = await self._fire_due()
                if full:
                    await self._wait(None)  # a page of them in flight: until one ends
                    continue
                wake_at = await self._next()
                delay = _RETRY_FIRST
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store cannot be read now: again after a backoff
                self._log.warning("scheduler_waits_for_store", error=repr(exc))
                await self._sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            await self._wait(wake_at)

    async def _fire_due(self) -> bool:
        """Start the firing of every due schedule not in flight or waiting to be retried;
        True when a whole page was due (more may be: read again once some are done)."""
        firer = self._firer
        served = firer.schedule_shards()
        shards, count = served if served is not None else (None, None)
        now = self.now()
        due = await firer.store.due_schedules(
            until=now, limit=PAGE, shards=shards, shard_count=count
        )
        started = 0
        clock = time.monotonic()
        for schedule in due:
            if schedule.id in self._firing:
                continue
            retry = self._retry.get(schedule.id)
            if retry is not None and retry[0] > clock:
                continue
            assert self._slots is not None
            await self._slots.acquire()
            task = asyncio.get_running_loop().create_task(self._fire_one(schedule))
            self._firing[schedule.id] = task
            started += 1
        if len(due) < PAGE and self._retry:  # forget retries of schedules no longer due
            ids = {schedule.id for schedule in due}
            self._retry = {k: v for k, v in self._retry.items() if k in ids}
        return len(due) == PAGE and (started > 0 or bool(self._firing))

    async def _next(self) -> int | None:
        """Epoch ms to wake at: the next due schedule's time, or a retry's, or None."""
        firer = self._firer
        served = firer.schedule_shards()
        shards, count = served if served is not None else (None, None)
        upcoming = await firer.store.next_due(after=self.now(), shards=shards, shard_count=count)
        if self._retry:
            soonest = min(at for at, _ in self._retry.values())
            retry_at = self.now() + max(0, int((soonest - time.monotonic()) * 1000))
            upcoming = retry_at if upcoming is None else min(upcoming, retry_at)
        return upcoming

    async def _wait(self, wake_at: int | None) -> None:
        self._target = wake_at
        seconds = MAX_SLEEP
        if wake_at is not None:
            seconds = min(MAX_SLEEP, max(0.0, (wake_at - self.now()) / 1000))
        await self._sleep(seconds)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    # -- one firing -----------------------------------------------------------------------
    async def _fire_one(self, schedule: Schedule) -> None:
        try:
            await self._attempt(schedule)
        finally:
            del self._firing[schedule.id]
            assert self._slots is not None
            self._slots.release()
            if self._target is None or self._retry:
                self._wake.set()  # the timer may wait for a page of firings to end

    async def _attempt(self, schedule: Schedule) -> None:
        assert schedule.due is not None
        every_ms = None if schedule.every is None else round(schedule.every * 1000)
        firing = Firing(schedule.id, schedule.due, next_due(schedule.due, every_ms, self.now()))
        try:
            await self._firer.fire(schedule, firing)
        except ScheduleGone:  # cancelled, or fired already (another node, a retry)
            self._retry.pop(schedule.id, None)
            return
        except (AgentParked, UnknownConversation) as exc:
            self._retry.pop(schedule.id, None)
            await self._drop(schedule, exc)
            return
        except RuntimeClosed:
            return  # stopping
        except Exception as exc:  # passes (store, Busy, a shard moving): again, later
            previous = self._retry.get(schedule.id)
            wait = _RETRY_FIRST if previous is None else previous[1]
            self._retry[schedule.id] = (time.monotonic() + wait, min(wait * 2, _RETRY_MAX))
            level = "debug" if isinstance(exc, NotOwner) else "warning"
            getattr(self._log, level)(
                "schedule_retry", conversation_id=schedule.conversation_id,
                schedule_id=schedule.id, retry_in=wait, error=repr(exc),
            )
            return
        self._retry.pop(schedule.id, None)
        self.fired += 1

    async def _drop(self, schedule: Schedule, cause: BaseException) -> None:
        """A parked or deleted conversation: its schedule goes, and the log says so."""
        try:
            await self._firer.store.remove_schedule(schedule.conversation_id, schedule.id)
        except UnknownConversation:
            pass
        except Exception as exc:  # the store cannot write now: dropped at a later try
            self._retry[schedule.id] = (time.monotonic() + _RETRY_FIRST, _RETRY_FIRST * 2)
            self._log.warning("schedule_drop_failed", conversation_id=schedule.conversation_id,
                              schedule_id=schedule.id, error=repr(exc))
            return
        self._log.warning(
            "schedule_dropped", conversation_id=schedule.conversation_id,
            schedule_id=schedule.id, reason=type(cause).__name__, error=str(cause),
        )
