"""Hold or delay a store's writes where a test chooses: the interleavings a slow commit makes.

:class:`HeldWrites` wraps the write methods of a real, open store (SQLite or
PostgreSQL) on the instance, the hook ``tests/test_answer_commit_seams.py``
uses (``rt.store`` is the object every runtime write goes through). Each
wrapper forwards to the store's own method; nothing of the store's behaviour
is imitated. A write no hold or delay wants is forwarded at once, as the same
call (a SQLite append is still queued when called, joining its group commit).

* ``hold(match)``: the next write ``match`` accepts waits until the test calls
  :meth:`Hold.release`; :attr:`Hold.reached` is set when it arrives. Held
  ``before`` it reaches the store (nothing written yet) or ``after`` its commit
  (written, its caller not yet back).
* ``delay``: a function that may return a :class:`Delay` for a write (the
  fuzzer's and the stress bench's random delays).

Used by tests/test_turn_numbers.py, tests/test_fuzz_runtime.py and
bench/turn_race.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from torpor.events import AssistantMessage, Body, UserMessage

__all__ = ["Delay", "HeldWrites", "Hold", "Write"]

# The write methods of both backends (torpor/store/core.py); ``_append_audited`` is the
# runtime's path for a model's answer and its audit row (one commit).
METHODS = ("append", "append_events", "_append_audited", "record_model_call", "put_checkpoint")


@dataclass(frozen=True)
class Write:
    """One call of a write method, as the store was asked."""

    method: str
    conversation_id: str
    bodies: tuple[Body, ...]
    turn: int | None  # None: not given (a checkpoint), or a default

    @property
    def user_texts(self) -> tuple[str, ...]:
        return tuple(b.text for b in self.bodies if isinstance(b, UserMessage))

    @property
    def answer(self) -> bool:
        """The write of a model's answer (with or without tool calls)."""
        return any(isinstance(b, AssistantMessage) for b in self.bodies)


def _describe(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Write:
    if method in ("append", "append_events"):
        return Write(method, args[0], tuple(args[1]), kwargs.get("turn", 0))
    if method == "_append_audited":  # (name, events, turn, head, call)
        return Write(method, args[0], tuple(args[1]), args[2])
    if method == "record_model_call":
        call = args[0]
        return Write(method, call.conversation_id, (), call.turn)
    checkpoint = args[0]
    return Write(method, checkpoint.conversation_id, (), None)


@dataclass
class Hold:
    """One write held until :meth:`release` (the first write ``match`` accepts).

    ``reached`` is also set when the hold is dropped unused (``write`` is None then)
    and when the write raised before an ``after`` hold: whoever waits never hangs.
    """

    match: Callable[[Write], bool]
    after: bool = False  # hold after the commit, before the caller gets the result
    reached: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)  # the write returned or raised
    write: Write | None = None
    _go: anyio.Event = field(default_factory=anyio.Event)

    def release(self) -> None:
        self._go.set()

    async def wait(self) -> None:
        await self._go.wait()


@dataclass(frozen=True)
class Delay:
    """Wait ``checkpoints`` scheduler passes, then ``seconds``; ``after``: past the commit."""

    checkpoints: int = 0
    seconds: float = 0.0
    after: bool = False

    async def wait(self) -> None:
        for _ in range(self.checkpoints):
            await anyio.lowlevel.checkpoint()
        if self.seconds > 0:
            await anyio.sleep(self.seconds)


class HeldWrites:
    """Wraps ``store``'s write methods while installed (``with HeldWrites(store) as w``)."""

    def __init__(
        self, store: Any, delay: Callable[[Write], Delay | None] | None = None
    ) -> None:
        self.store = store
        self.delay = delay
        self.holds: list[Hold] = []  # armed: no write has matched them yet
        self._given: list[Hold] = []
        self.writes: list[Write] = []  # every write asked for, in call order
        self.in_flight = 0  # writes held or delayed right now (not yet returned)
        self._originals: dict[str, Any] = {}

    def hold(self, match: Callable[[Write], bool], *, after: bool = False) -> Hold:
        hold = Hold(match, after)
        self.holds.append(hold)
        self._given.append(hold)
        return hold

    def drop(self, hold: Hold) -> None:
        """Release ``hold``; if no write has taken it yet, none will."""
        if hold in self.holds:
            self.holds.remove(hold)
            hold.reached.set()
        hold.release()

    def release_all(self) -> None:
        """Release every hold given out; those no write reached are dropped."""
        for hold in self._given:
            hold.release()
            hold.reached.set()
        self.holds.clear()
        self._given.clear()

    def install(self) -> None:
        for method in METHODS:
            original = getattr(self.store, method, None)
            if original is not None:
                self._originals[method] = original
                setattr(self.store, method, self._wrap(method, original))

    def uninstall(self) -> None:
        self.release_all()
        for method in self._originals:
            delattr(self.store, method)  # the class's method shows through again
        self._originals.clear()

    def __enter__(self) -> HeldWrites:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _wrap(self, method: str, original: Callable[..., Awaitable[Any]]) -> Any:
        def write(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            described = _describe(method, args, kwargs)
            self.writes.append(described)
            hold = next((h for h in self.holds if h.match(described)), None)
            if hold is not None:
                self.holds.remove(hold)  # one write per hold
                hold.write = described
                return self._held(hold, original, args, kwargs)
            delay = self.delay(described) if self.delay is not None else None
            if delay is None:
                return original(*args, **kwargs)  # the very call: queued now, as without us
            return self._delayed(delay, original, args, kwargs)

        return write

    async def _held(
        self, hold: Hold, original: Callable[..., Awaitable[Any]], args: Any, kwargs: Any
    ) -> Any:
        self.in_flight += 1
        try:
            if not hold.after:
                hold.reached.set()
                await hold.wait()
            result = await original(*args, **kwargs)
            if hold.after:
                hold.reached.set()
                await hold.wait()
            return result
        finally:
            self.in_flight -= 1
            hold.reached.set()  # a write that failed before the hold: nobody waits for good
            hold.done.set()

    async def _delayed(
        self, delay: Delay, original: Callable[..., Awaitable[Any]], args: Any, kwargs: Any
    ) -> Any:
        self.in_flight += 1
        try:
            if not delay.after:
                await delay.wait()
            result = await original(*args, **kwargs)
            if delay.after:
                await delay.wait()
            return result
        finally:
            self.in_flight -= 1
