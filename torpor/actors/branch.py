"""Linking a sub-agent to a suspended call, done by the parent's actor.

``Runtime.spawn`` posts a :class:`~torpor.actors.mailbox.SpawnRequest` to the
parent; the parent's actor (the one writer of its log) checks that it waits for
that call, starts the child's log with :class:`~torpor.events.Spawned` (the
link and the task; idempotent, and refused if the child id is taken), then logs
``Spawned`` in its own open turn. A call already linked keeps its first child,
so a spawn retried after a crash links once.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from torpor.actors.state import AgentState
from torpor.actors.turn_loop import append
from torpor.errors import ConflictError, InvalidInput, StoreUnavailable, UnknownCall
from torpor.events import Spawned

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host
    from torpor.actors.mailbox import SpawnRequest

__all__ = ["handle_spawn", "link_key", "linked_child"]


def link_key(kind: str, parent: str, call_id: str) -> str:
    """An idempotency key for one of a link's writes (``kind``: "spawn", "task")."""
    digest = hashlib.sha256(f"{parent}\x00{call_id}".encode()).hexdigest()[:32]
    return f"torpor-{kind}-{digest}"


def linked_child(agent: Agent, call_id: str) -> str | None:
    """The child already linked to ``call_id`` in the agent's open turn, if any."""
    ws = agent.ws
    if ws is None:
        return None
    for event in reversed(ws.tail):
        body = event.body
        if isinstance(body, Spawned) and body.call_id == call_id:
            return body.child
        if event.turn < agent.turn:
            break
    return None


async def handle_spawn(agent: Agent, host: Host, request: SpawnRequest) -> None:
    done = request.done
    if agent.state is not AgentState.SUSPENDED or request.call_id not in agent.pending:
        waiting = f"{agent.id}: not waiting for tool call {request.call_id!r}"
        done.set_exception(UnknownCall(waiting))
        return
    child = linked_child(agent, request.call_id)
    if child is None:
        child = request.child
        link = Spawned(agent.id, request.call_id, child, request.task)
        try:
            await host.store.append(child, [link], expect_head=-1,
                                    key=link_key("spawn", agent.id, request.call_id))
            await append(agent, host, [Spawned(agent.id, request.call_id, child)])
        except ConflictError:
            if not done.done():  # its caller may have given up meanwhile
                done.set_exception(InvalidInput("child", f"{child!r} is already a conversation"))
            return
        except StoreUnavailable as exc:  # our log is unchanged: still suspended, unlinked
            if not done.done():
                done.set_exception(exc)
            return
    if not done.done():
        done.set_result(child)
