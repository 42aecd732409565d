"""The actor's task body: revive, take messages in order, run turns, hibernate when told.

One asyncio task per live conversation, owned by the runtime's supervisor. It
returns when hibernated (dropping its caches) and raises when it crashes; the
supervisor restarts it from the log.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

from torpor.actors.mailbox import CancelRequest, Message, ResolveRequest, SendRequest
from torpor.actors.revive import restore
from torpor.actors.state import AgentState
from torpor.actors.stream import StreamHub
from torpor.actors.turn import Turn
from torpor.actors.turn_loop import ModelFailed, StepLimit, append, run_steps
from torpor.compaction.working_set import WorkingSet
from torpor.errors import AgentParked, ConflictError, TurnAborted, UnknownCall
from torpor.events import (
    Aborted,
    AbortReason,
    AssistantMessage,
    Resolved,
    ToolResult,
    UserMessage,
)

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host

__all__ = ["abort_turn", "run_agent"]


async def run_agent(agent: Agent, host: Host, *, delay: float = 0.0) -> None:
    """The actor loop. ``delay``: restart backoff after a crash."""
    if delay > 0:
        await anyio.sleep(delay)
    while True:
        if agent.state is AgentState.PARKED:
            _refuse_all(agent)
            return
        if agent.ws is None and (agent.mailbox_depth() or agent.state is AgentState.REVIVING):
            await revive(agent, host)  # eager after a restart: it proves the log reads back
            continue
        message = agent.next_message()
        if message is None:
            if agent.hibernate_requested or agent.state is AgentState.STOPPED:
                _hibernate(agent)
                return
            await agent.wait()
            continue
        agent.hibernate_requested = False
        if isinstance(message, SendRequest):
            await _handle_send(agent, host, message)
        elif isinstance(message, ResolveRequest):
            await _handle_resolve(agent, host, message)
        else:
            await _handle_cancel(agent, host, message)
        agent.last_active = time.monotonic()
        host.on_idle(agent)


def _hibernate(agent: Agent) -> None:
    agent.ws = None
    agent.hub = None
    agent.ws_tokens = 0
    agent.ws_bytes = 0
    agent.hibernate_requested = False


def _refuse_all(agent: Agent) -> None:
    mailbox = agent.mailbox
    agent.mailbox = None
    if mailbox is None:
        return
    error = AgentParked(agent.id, agent.parked_cause or "parked")
    for message in mailbox.drain():
        _fail(message, error)


def _fail(message: Message, error: BaseException) -> None:
    future = message.accepted if isinstance(message, SendRequest) else message.done
    if not future.done():
        future.set_exception(error)


async def revive(agent: Agent, host: Host) -> None:
    """Rebuild the working set from the latest checkpoint plus events since: one store trip."""
    if agent.state is not AgentState.REVIVING:
        agent.set_state(host, AgentState.REVIVING)
    started = time.perf_counter()
    async with host.revival_slot():
        resume = await host.store.resume(agent.id)
    ws = WorkingSet(agent.id, resume.checkpoint, resume.events)
    restored = restore(resume.events)
    agent.ws = ws
    agent.head = resume.head if resume.head is not None else -1
    agent.turn = restored.turn
    agent.cycle = resume.checkpoint.cycle if resume.checkpoint is not None else 0
    agent.pending = restored.pending
    agent.parked_cause = restored.parked_cause
    if restored.unfinished and restored.state is not AgentState.PARKED:
        # The process died mid-turn: the log must say so before anything else happens.
        await append(agent, host, [Aborted("interrupted", detail="found unfinished on revival")])
    _measure(agent)
    agent.set_state(host, restored.state)
    host.on_revived(agent, time.perf_counter() - started)


def _measure(agent: Agent) -> None:
    ws = agent.ws
    if ws is not None:
        agent.ws_tokens = ws.tail_tokens
        agent.ws_bytes = ws.estimated_bytes()


async def _handle_send(agent: Agent, host: Host, request: SendRequest) -> None:
    if request.accepted.done():  # the caller gave up before its turn came
        return
    next_turn = agent.turn + 1
    try:
        events = await host.store.append_events(
            agent.id,
            [UserMessage(request.text)],
            turn=next_turn,
            expect_head=agent.head,
            key=request.key,
        )
    except ConflictError as exc:
        # Someone else wrote this conversation: our view is stale. Fail the send and
        # crash so the supervisor revives us from the log.
        request.accepted.set_exception(exc)
        raise
    except Exception as exc:
        if not request.accepted.done():
            request.accepted.set_exception(exc)
        if isinstance(exc, (ValueError, TypeError)):
            return  # bad input: nothing was written, the agent is fine
        raise
    event = events[0]
    if event.position <= agent.head:
        await _replay(agent, host, request, event.position, event.turn)
        return
    ws = agent.ws
    assert ws is not None
    ws.append(events)
    agent.head = event.position
    agent.turn = next_turn
    agent.calls = 0
    hub = StreamHub()
    hub.subscribers.extend(host.take_subscribers(agent))
    agent.hub = hub
    turn = Turn(agent.id, next_turn, event.position, hub.join())
    agent.current = turn
    if not request.accepted.done():
        request.accepted.set_result(turn)
    await _run_turn(agent, host)


async def _replay(
    agent: Agent, host: Host, request: SendRequest, position: int, number: int
) -> None:
    """An idempotent retry: hand back the original turn, running or finished."""
    current = agent.current
    if current is not None and current.user_position == position:
        request.accepted.set_result(current)
        return
    hub = StreamHub()
    turn = Turn(agent.id, number, position, hub.join(), replayed=True)
    final: AssistantMessage | None = None
    aborted: Aborted | None = None
    for event in await host.store.read_since(agent.id, position + 1):
        if event.turn != number:
            break
        body = event.body
        if isinstance(body, AssistantMessage) and not body.tool_calls:
            final = body
        elif isinstance(body, Aborted):
            aborted = body
    if final is not None:
        turn._finish(final)
    else:
        reason = aborted.reason if aborted is not None else "interrupted"
        turn._fail(TurnAborted(reason, aborted.partial_text if aborted else ""))
    request.accepted.set_result(turn)


async def _run_turn(agent: Agent, host: Host) -> None:
    """Run (or continue) the current turn; every way it can end is logged."""
    reason: AbortReason | None = None
    detail = ""
    partial = ""
    final: AssistantMessage | None = None
    crash: BaseException | None = None
    try:
        with anyio.CancelScope() as scope:
            agent.scope = scope
            try:
                final = await run_steps(agent, host)
            except ModelFailed as exc:
                reason, detail, partial = "model_error", str(exc), exc.partial
            except StepLimit as exc:
                reason, detail = "step_limit", str(exc)
        if scope.cancelled_caught:
            reason, detail = "cancelled", "cancelled by caller"
    except anyio.get_cancelled_exc_class():
        reason, detail, crash = "shutdown", "runtime stopped", None
        with anyio.CancelScope(shield=True):
            await abort_turn(agent, host, reason, detail, _partial(agent))
        raise
    except Exception as exc:
        crash = exc
        reason, detail = "crashed", f"{type(exc).__name__}: {exc}"
    finally:
        agent.scope = None
    if reason == "cancelled":
        partial = _partial(agent)
    if reason is not None:
        try:
            await abort_turn(agent, host, reason, detail, partial)
        except Exception:
            if crash is None:
                raise
        if crash is not None:
            raise crash
        return
    if final is None:  # suspended: the turn stays open
        agent.set_state(host, AgentState.SUSPENDED)
        _measure(agent)
        return
    turn = agent.current
    agent.current = None
    hub = agent.hub
    agent.hub = None
    agent.pending = ()
    agent.set_state(host, AgentState.AWAITING_INPUT)
    _measure(agent)
    if turn is not None:
        turn._finish(final)
    if hub is not None:
        hub.close()


def _partial(agent: Agent) -> str:
    hub = agent.hub
    return "".join(hub.parts) if hub is not None else ""


async def abort_turn(
    agent: Agent, host: Host, reason: AbortReason, detail: str, partial: str
) -> None:
    """Log an Aborted for the current turn and fail everyone waiting on it."""
    turn = agent.current
    hub = agent.hub
    agent.current = None
    agent.hub = None
    agent.pending = ()
    error = TurnAborted(reason, partial, detail)
    try:
        if agent.ws is not None:
            await append(agent, host, [Aborted(reason, partial_text=partial, detail=detail)])
    finally:
        if turn is not None:
            turn._fail(error)
        if hub is not None:
            hub.close(error)
        if agent.state not in (AgentState.AWAITING_INPUT, AgentState.PARKED,
                               AgentState.STOPPED):
            agent.set_state(host, AgentState.AWAITING_INPUT)
        _measure(agent)


async def _handle_resolve(agent: Agent, host: Host, request: ResolveRequest) -> None:
    if agent.state is not AgentState.SUSPENDED or request.call_id not in agent.pending:
        request.done.set_exception(
            UnknownCall(f"{agent.id}: not waiting for tool call {request.call_id!r}")
        )
        return
    ws = agent.ws
    assert ws is not None
    tool = _tool_name(ws, request.call_id)
    result = ToolResult(request.call_id, tool, request.content, is_error=request.is_error)
    await append(agent, host, [result, Resolved(request.call_id)])
    agent.pending = tuple(c for c in agent.pending if c != request.call_id)
    if agent.pending:
        request.done.set_result(None)
        _measure(agent)
        return
    if agent.hub is None:  # revived since the suspension: a fresh fan-out for the rest
        agent.hub = StreamHub()
    if agent.current is None:
        agent.current = Turn(agent.id, agent.turn, _turn_start(ws, agent.turn), agent.hub.join())
    agent.calls = 0
    request.done.set_result(agent.current)
    await _run_turn(agent, host)


def _tool_name(ws: WorkingSet, call_id: str) -> str:
    for event in reversed(ws.tail):
        body = event.body
        if isinstance(body, AssistantMessage):
            for call in body.tool_calls:
                if call.id == call_id:
                    return call.name
    return "external"


def _turn_start(ws: WorkingSet, turn: int) -> int:
    for event in ws.tail:
        if event.turn == turn:
            return event.position
    return ws.head if ws.head is not None else -1


async def _handle_cancel(agent: Agent, host: Host, request: CancelRequest) -> None:
    if agent.state is not AgentState.SUSPENDED:
        request.done.set_result(False)
        return
    await abort_turn(agent, host, "cancelled", "suspended turn cancelled by caller", "")
    request.done.set_result(True)
