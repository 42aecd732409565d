"""Runtime counters and the lifecycle transitions an operator can watch."""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Iterator

import msgspec

__all__ = ["Counters", "Samples", "Transition", "Watcher", "Watchers", "percentile"]


class Transition(msgspec.Struct, frozen=True, gc=False):
    """One lifecycle change of one agent, as ``rt.admin.watch()`` yields it."""

    conversation_id: str
    old: str
    new: str
    at: float  # time.time()


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Samples:
    """The last ``size`` float samples, oldest first, in one array.

    Not a deque of floats: those are one small object per sample, and the ones
    written during a burst (every revival of it) pinned the heap around them long
    after the burst's working sets were freed.
    """

    __slots__ = ("_next", "_size", "_values")

    def __init__(self, size: int) -> None:
        self._values = array("d")
        self._size = size
        self._next = 0  # where the next sample goes once full

    def append(self, value: float) -> None:
        values = self._values
        if len(values) < self._size:
            values.append(value)
        else:
            values[self._next] = value
            self._next = (self._next + 1) % self._size

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[float]:
        values, at = self._values, self._next
        return iter(values[at:] + values[:at])


class Counters:
    """Monotonic counts plus a bounded window of recent revival latencies."""

    __slots__ = (
        "abandoned",
        "activations",
        "consolidation_failures",
        "crashes",
        "evictions",
        "hibernations",
        "parks",
        "restarts",
        "retention_deletions",
        "revival_seconds",
        "revivals",
        "store_failures",
    )

    def __init__(self) -> None:
        self.activations = 0  # records created for a conversation not in memory
        self.revivals = 0  # working sets read back from the log
        self.hibernations = 0
        self.evictions = 0
        self.crashes = 0
        self.restarts = 0
        self.parks = 0
        self.store_failures = 0  # turns or revivals stopped by StoreUnavailable (not crashes)
        self.abandoned = 0  # tasks that ignored cancellation past their deadline
        self.consolidation_failures = 0  # idle-sweep consolidations that failed or timed out
        self.retention_deletions = 0  # conversations deleted by the retention sweep
        self.revival_seconds = Samples(4096)


class Watcher:
    """One admin watcher: registered when created, so nothing after that is missed."""

    __slots__ = ("_hub", "dropped", "items", "waiter")

    def __init__(self, hub: Watchers, bound: int) -> None:
        self._hub = hub
        self.items: deque[Transition] = deque(maxlen=bound)
        self.waiter: asyncio.Future[None] | None = None
        self.dropped = 0

    def __aiter__(self) -> AsyncIterator[Transition]:
        return self

    @property
    def open(self) -> bool:
        """Whether transitions may still come (not closed, the runtime running)."""
        return not self._hub.closed and self in self._hub.watchers

    async def __anext__(self) -> Transition:
        while not self.items:
            if not self.open:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()

    def close(self) -> None:
        if self in self._hub.watchers:
            self._hub.watchers.remove(self)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Watchers:
    """Fan-out of transitions to admin watchers; a slow watcher loses the oldest, not memory."""

    __slots__ = ("closed", "watchers")

    def __init__(self) -> None:
        self.watchers: list[Watcher] = []
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self.watchers)

    def publish(self, conversation_id: str, old: str, new: str) -> None:
        item = Transition(conversation_id, old, new, time.time())
        for w in self.watchers:
            if len(w.items) == w.items.maxlen:
                w.dropped += 1
            w.items.append(item)
            if w.waiter is not None and not w.waiter.done():
                w.waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        for w in list(self.watchers):
            w.close()

    def watch(self, bound: int = 10_000) -> Watcher:
        watcher = Watcher(self, bound)
        self.watchers.append(watcher)
        return watcher
