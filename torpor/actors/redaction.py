"""An actor's side of ``Runtime.redact``: the store redacts, the working set follows.

The request goes through the agent's mailbox like every change to its conversation,
so it is ordered with the actor's own writes. It is carried out between turns: one
taken while a turn runs waits for that turn's end (the turn's model calls and any
fold it makes read the working set, which still holds the text until then; a fold
written after the redaction would copy it back). Then, under the write lock:

1. the store redacts (one transaction: :mod:`torpor.store.redact`), which also drops
   every checkpoint that covered the position;
2. the working set is rebuilt from the log (a revival: the latest checkpoint left and
   the events since, a redacted one shown as its stand-in, ``[redacted]``), so the
   next model call renders the redaction, and the next fold refolds from the log.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from torpor.actors.write_lock import WriteLock

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host
    from torpor.actors.mailbox import RedactRequest
    from torpor.store.protocol import EventStore

__all__ = ["carry_out", "carry_out_deferred", "defer", "fail_deferred", "redact_unserved"]


def defer(agent: Agent, request: RedactRequest) -> None:
    """Hold ``request`` until the running turn ends (its end wakes the actor)."""
    if agent.redactions is None:
        agent.redactions = []
    agent.redactions.append(request)


def fail_deferred(agent: Agent, error: BaseException) -> None:
    held, agent.redactions = agent.redactions, None
    for request in held or ():
        if not request.done.done():
            request.done.set_exception(error)
            request.done.exception()  # a caller that gave up must not leave "never retrieved"


async def carry_out(
    agent: Agent, host: Host, request: RedactRequest,
    rebuild: Callable[[Agent, Host], Awaitable[None]],
) -> None:
    """Redact in the store under the write lock, answer, and rebuild the working set."""
    if request.done.done():  # the caller gave up before it was taken
        return
    lock = agent.lock
    made = lock is None
    if lock is None:
        lock = agent.lock = WriteLock()
    try:
        with anyio.CancelScope(shield=True):  # written and answered, or neither
            async with lock:
                changed = await host.store.redact(
                    agent.id, request.position, reason=request.reason
                )
    except Exception as exc:  # InvalidInput, UnknownConversation, StoreUnavailable, …
        if not request.done.done():
            request.done.set_exception(exc)
        return
    finally:
        if made and agent.ws is None and agent.lock is lock:
            agent.lock = None  # nothing was live: nothing to keep
    if not request.done.done():
        request.done.set_result(changed)
    if changed and agent.ws is not None:
        agent.topic = None  # the last call's label may be a word of the text
        await rebuild(agent, host)


async def carry_out_deferred(
    agent: Agent, host: Host, rebuild: Callable[[Agent, Host], Awaitable[None]]
) -> None:
    held, agent.redactions = agent.redactions, None
    for request in held or ():
        await carry_out(agent, host, request, rebuild)


async def redact_unserved(agent: Agent, store: EventStore, position: int, reason: str) -> bool:
    """A redaction for an agent whose actor serves nothing (parked): in the store, under
    the write lock its revival (an unpark) would take, so it reads the redacted log."""
    lock = agent.lock
    made = lock is None
    if lock is None:
        lock = agent.lock = WriteLock()
    try:
        async with lock:
            return await store.redact(agent.id, position, reason=reason)
    finally:
        if made and agent.ws is None and agent.lock is lock:
            agent.lock = None
