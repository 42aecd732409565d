"""The actor's task body: revive, take messages in order, run turns, hibernate when told.

One asyncio task per live conversation, owned by the runtime's supervisor. It
returns when hibernated (dropping its caches) and raises when it crashes; the
supervisor restarts it from the log.

Input and turns: a user message is logged as soon as it is taken, whatever the
state. If no turn is open its turn starts at once; if one is open (streaming,
running tools, suspended on an approval) the new turn is *postponed*: it runs
when the open one ends, in arrival order, and the model sees it after that
turn (see :mod:`torpor.compaction.order`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from torpor.actors.agent import Waiting
from torpor.actors.branch import handle_spawn
from torpor.actors.mailbox import (
    CancelRequest,
    CardRequest,
    Message,
    ResolveRequest,
    SendRequest,
    SpawnRequest,
)
from torpor.actors.revive import restore
from torpor.actors.scopes import scope
from torpor.actors.state import AgentState
from torpor.actors.stream import StreamHub
from torpor.actors.task import card_change
from torpor.actors.turn import Turn
from torpor.actors.turn_loop import ModelFailed, StepLimit, append, logged, run_steps
from torpor.actors.write_lock import WriteLock
from torpor.compaction.order import up_to_turn
from torpor.compaction.working_set import WorkingSet
from torpor.errors import AgentParked, StoreUnavailable, TurnAborted, UnknownCall
from torpor.events import (
    Aborted,
    AbortReason,
    AssistantMessage,
    Event,
    Resolved,
    Suspended,
    ToolResult,
    UserMessage,
)

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host

__all__ = ["abort_turn", "fail", "postpone", "replayed_turn", "run_agent"]


async def run_agent(agent: Agent, host: Host, *, delay: float = 0.0) -> None:
    """The actor loop. ``delay``: restart backoff after a crash."""
    if delay > 0:
        await anyio.sleep(delay)
    while True:
        if agent.state is AgentState.PARKED:
            _refuse_all(agent)
            return
        if agent.ws is None and (agent.mailbox_depth() or agent.runnable_postponed()
                                 or agent.state is AgentState.REVIVING):
            await revive(agent, host)  # eager after a restart: it proves the log reads back
            continue
        if agent.postponed and agent.state is AgentState.AWAITING_INPUT:
            _start_postponed(agent, host)
            await _run_turn(agent, host)  # here, not inside a helper: one frame less per turn
        else:
            message = agent.next_message()
            if message is None:
                if agent.hibernate_requested or agent.state is AgentState.STOPPED:
                    _hibernate(agent)
                    return
                # Awaited here, not through a helper coroutine: one frame less per idle
                # agent for the cyclic GC to walk; Agent.wake resolves it.
                waiter = agent.waiter = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    agent.waiter = None
                continue
            agent.hibernate_requested = False
            agent.taken = message  # left set if cancelled: the canceller answers it
            if isinstance(message, SendRequest):
                # This frame must not keep the request while the turn runs (its commits
                # may wait behind thousands of others: one more object for the GC each).
                send = _handle_send(agent, host, message)
                message = None
                started = await send
                del send
                if started:  # run here, not inside the handler: one frame less per turn
                    await _run_turn(agent, host)
            elif isinstance(message, ResolveRequest):
                await _handle_resolve(agent, host, message)
            elif isinstance(message, SpawnRequest):
                await handle_spawn(agent, host, message)
            elif isinstance(message, CardRequest):
                await _handle_card(agent, host, message)
            else:
                await _handle_cancel(agent, host, message)
            agent.taken = None
        agent.last_active = time.monotonic()
        host.on_idle(agent)


def _hibernate(agent: Agent) -> None:
    agent.ws = None
    agent.hub = None
    agent.lock = None
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
        fail(message, error)


def fail(message: Message, error: BaseException) -> None:
    """Complete a request's future with ``error`` (if nobody completed it yet)."""
    future: asyncio.Future[object]
    future = message.accepted if isinstance(message, SendRequest) else message.done  # type: ignore[assignment]
    if not future.done():
        future.set_exception(error)
        future.exception()  # a caller that gave up must not leave "never retrieved"


async def revive(agent: Agent, host: Host) -> None:
    """Rebuild the working set from the latest checkpoint plus events since: one store trip."""
    if agent.state is not AgentState.REVIVING:
        agent.set_state(host, AgentState.REVIVING)
    started = time.perf_counter()
    async with host.revival_slot():
        resume = await host.store.resume(agent.id)
    # Turns this record holds handles for were postponed, even where the turn before
    # them had ended (a conversation that queued for a slot): they run, not abort.
    held = frozenset(w.event.position for w in agent.postponed) if agent.postponed else None
    restored = restore(resume.events, postponed=held)
    ws = WorkingSet(agent.id, resume.checkpoint, up_to_turn(resume.events, restored.turn))
    agent.ws = ws
    agent.lock = WriteLock()
    agent.head = resume.head if resume.head is not None else -1
    agent.turn = restored.turn
    agent.cycle = resume.checkpoint.cycle if resume.checkpoint is not None else 0
    agent.pending = restored.pending
    agent.parked_cause = restored.parked_cause
    _adopt_postponed(agent, host, restored.postponed)
    if restored.unfinished and restored.state is not AgentState.PARKED:
        # The turn died mid-way (the process, or the store): the log must say so before
        # anything else happens, with the text its stream had delivered.
        await append(agent, host, [Aborted("interrupted", partial_text=agent.unlogged,
                                           detail="found unfinished on revival")])
    agent.unlogged = ""
    agent.store_failures = 0
    _measure(agent)
    agent.set_state(host, restored.state)
    host.on_revived(agent, time.perf_counter() - started)


def _adopt_postponed(agent: Agent, host: Host, events: tuple[Event, ...]) -> None:
    """Postponed turns found in the log; callers' handles from before a restart are kept."""
    known = {w.event.position: w for w in agent.postponed} if agent.postponed else {}
    if not events:
        agent.postponed = None
    else:
        queue: list[Waiting] = []
        for event in events:
            waiting = known.pop(event.position, None)
            if waiting is None:
                hub = StreamHub(host.followers(agent.id))
                turn = Turn(agent.id, event.turn, event.position, hub.join(), postponed=True)
                waiting = Waiting(event, turn, hub)
            queue.append(waiting)
        agent.postponed = queue
    for stale in known.values():  # not in the log after all: nothing of it will run
        stale.turn._fail(TurnAborted("interrupted", "", "postponed message not found on revival"))


def _measure(agent: Agent) -> None:
    ws = agent.ws
    if ws is not None:
        agent.ws_tokens = ws.tail_tokens
        agent.ws_bytes = ws.estimated_bytes()


async def _handle_send(agent: Agent, host: Host, request: SendRequest) -> bool:
    """Log the request's message and make its turn current: True when the turn is to run."""
    if request.accepted.done():  # the caller gave up before its turn came
        return False
    if agent.state is not AgentState.AWAITING_INPUT or agent.postponed:
        # A turn is open (suspended on an approval): log it now, run it after.
        await _postpone_request(agent, host, request)
        return False
    next_turn = agent.turn + 1
    try:
        # No shield: no cancel scope encloses the actor here (a turn's opens below), and
        # the runtime stops its actors with Task.cancel, which no scope holds back.
        events = await logged(
            agent, host, [UserMessage(request.text)], turn=next_turn, key=request.key
        )
    except StoreUnavailable as exc:
        fail(request, exc)
        return False
    except Exception as exc:
        # A conflict means someone else wrote this conversation: our view is stale, so
        # fail the send and crash; the supervisor revives us from the log.
        fail(request, exc)
        if isinstance(exc, ValueError | TypeError):
            return False  # bad input: nothing was written, the agent is fine
        raise
    event = events[0]
    if event.turn != next_turn:  # an idempotent retry of an earlier send
        await _replay(agent, host, request, event.position, event.turn)
        return False
    ws = agent.ws
    assert ws is not None
    ws.append(events)
    agent.turn = next_turn
    agent.calls = 0
    hub = StreamHub(host.followers(agent.id))
    agent.hub = hub
    turn = Turn(agent.id, next_turn, event.position, hub.join())
    agent.current = turn
    if not request.accepted.done():
        request.accepted.set_result(turn)
    return True


async def postpone(agent: Agent, host: Host, text: str, key: str | None) -> Turn:
    """Log a user message behind the open turn; its turn runs when that one ends.

    Called by the actor (a message taken while suspended) and by ``Runtime.send``
    itself while the actor is busy streaming, so ``send`` returns as soon as the
    message is durable. Shielded: once written, the postponed turn is registered
    even if the caller gave up meanwhile (the log has it; it must be answered).
    """
    with anyio.CancelScope(shield=True):
        # Counted towards the bound while it is written: a second send arriving meanwhile
        # must see it, or concurrent sends would all pass the check before any is queued.
        agent.logging_sends += 1
        try:
            events = await logged(
                agent, host, [UserMessage(text)], turn=_next_turn(agent), key=key
            )
        finally:
            agent.logging_sends -= 1
        event = events[0]
        if event.turn <= agent.last_turn():  # an idempotent retry: a number already given
            return await replayed_turn(agent, host, event.position, event.turn)
        hub = StreamHub(host.followers(agent.id))
        turn = Turn(agent.id, event.turn, event.position, hub.join(), postponed=True)
        if agent.postponed is None:
            agent.postponed = []
        agent.postponed.append(Waiting(event, turn, hub))
    host.log.debug("postponed", conversation_id=agent.id, turn=event.turn,
                   position=event.position)
    return turn


async def _postpone_request(agent: Agent, host: Host, request: SendRequest) -> None:
    try:
        turn = await postpone(agent, host, request.text, request.key)
    except StoreUnavailable as exc:
        fail(request, exc)  # nothing was written; the agent is fine
        return
    except Exception as exc:
        fail(request, exc)
        if isinstance(exc, ValueError | TypeError):
            return  # bad input: nothing was written
        raise
    if not request.accepted.done():
        request.accepted.set_result(turn)


async def _take_waiting(agent: Agent, host: Host) -> None:
    """A turn starts: nothing already in the mailbox may wait for it to end.

    The actor reads its mailbox only between turns, and a turn may run for
    minutes. So what was posted before this turn began is settled now: a user
    message is logged and postponed behind it (its caller gets its Turn), a
    cancel applies to it, and an answer is refused, since the agent waits for
    no call while a turn starts. Anything posted from here on is settled by the
    runtime directly (see ``Runtime.send``, ``cancel`` and ``resolve``).
    """
    while (message := agent.next_message()) is not None:
        if isinstance(message, SendRequest):
            if not message.accepted.done():
                await _postpone_request(agent, host, message)
        elif isinstance(message, CancelRequest):
            if agent.cancels is None:
                agent.cancels = []
            agent.cancels.append(message.done)  # answered when this turn ends
        elif isinstance(message, CardRequest):
            await _handle_card(agent, host, message)  # in effect from this turn's first call
        elif not message.done.done():
            message.done.set_exception(
                UnknownCall(f"{agent.id}: not waiting for tool call {message.call_id!r}")
            )


def _next_turn(agent: Agent) -> Callable[[], int]:
    return lambda: agent.last_turn() + 1


def _start_postponed(agent: Agent, host: Host) -> None:
    """Make the first postponed turn the current one (the caller runs it)."""
    postponed = agent.postponed
    assert postponed
    waiting = postponed.pop(0)  # a few at most (mailbox_bound): a list is 700 bytes lighter
    if not postponed:
        agent.postponed = None
    ws = agent.ws
    assert ws is not None
    ws.append([waiting.event])
    agent.turn = waiting.event.turn
    agent.calls = 0
    hub = waiting.hub
    hub.followers = host.followers(agent.id)
    agent.hub = hub
    agent.current = waiting.turn


async def _replay(
    agent: Agent, host: Host, request: SendRequest, position: int, number: int
) -> None:
    """An idempotent retry: hand back the original turn, running or finished."""
    turn = await replayed_turn(agent, host, position, number)
    if not request.accepted.done():
        request.accepted.set_result(turn)


async def replayed_turn(agent: Agent, host: Host, position: int, number: int) -> Turn:
    current = agent.current
    if current is not None and current.user_position == position:
        return current
    for waiting in agent.postponed or ():
        if waiting.event.position == position:
            return waiting.turn
    hub = StreamHub()
    turn = Turn(agent.id, number, position, hub.join(), replayed=True)
    outcome: AssistantMessage | Suspended | None = None
    aborted: Aborted | None = None
    for event in await host.store.read_since(agent.id, position + 1):
        if event.turn != number:
            continue  # a postponed message of a later turn may sit inside this one
        body = event.body
        if isinstance(body, Suspended) or (
            isinstance(body, AssistantMessage) and not body.tool_calls
        ):
            outcome = body
        elif isinstance(body, ToolResult | Resolved):
            outcome = None  # answered since: the suspension is over
        elif isinstance(body, Aborted):
            aborted = body
    if outcome is not None:
        turn._finish(outcome)
    else:
        reason = aborted.reason if aborted is not None else "interrupted"
        turn._fail(TurnAborted(reason, aborted.partial_text if aborted else ""))
    return turn


async def _run_turn(agent: Agent, host: Host) -> None:
    """Run (or continue) the current turn; every way it can end is logged."""
    reason: AbortReason | None = None
    detail = ""
    partial = ""
    final: AssistantMessage | None = None
    crash: BaseException | None = None
    model_error: BaseException | None = None
    try:
        with scope() as turn_scope:
            agent.scope = turn_scope
            try:
                if agent.mailbox is not None:  # usually empty: no coroutine then
                    await _take_waiting(agent, host)
                final = await run_steps(agent, host)
            except ModelFailed as exc:
                reason, detail, partial = "model_error", str(exc), exc.partial
                model_error = exc.cause
            except StepLimit as exc:
                reason, detail = "step_limit", str(exc)
        if turn_scope.cancelled_caught:
            reason, detail = "cancelled", "cancelled by caller"
    except anyio.get_cancelled_exc_class():
        try:
            with anyio.CancelScope(shield=True):
                await abort_turn(agent, host, "shutdown", "runtime stopped", _partial(agent))
        finally:
            _answer_cancels(agent, True)
        raise
    except Exception as exc:
        crash = exc
        reason, detail = "crashed", f"{type(exc).__name__}: {exc}"
    finally:
        agent.scope = None
        agent.cancellable = False
    if reason in ("cancelled", "crashed"):
        partial = _partial(agent)  # what the stream delivered: the abort holds it
    if reason is None and final is None and agent.cancels:
        # Suspended with a cancel waiting: the caller asked to stop this turn.
        reason, detail = "cancelled", "suspended turn cancelled by caller"
    if reason is not None:
        if isinstance(crash, StoreUnavailable):
            _answer_cancels(agent, False, crash)  # nothing could be logged: not cancelled
            raise crash  # nothing more can be logged now; the supervisor retries later
        try:
            await abort_turn(agent, host, reason, detail, partial, model_error)
        except Exception as exc:
            # The abort is not in the log, so no cancel took effect: its callers get the
            # error (a cancel is True only once the log ends the turn with it).
            _answer_cancels(agent, False, exc)
            if crash is None:
                raise
        else:
            _answer_cancels(agent, reason == "cancelled")
        if crash is not None:
            raise crash
        return
    _answer_cancels(agent, False)  # the turn got to its end first: too late
    turn = agent.current
    agent.current = None
    hub = agent.hub
    agent.hub = None
    if final is None:  # suspended: this part of the turn is over, the turn stays open
        agent.set_state(host, AgentState.SUSPENDED)
        _measure(agent)
        if turn is not None:
            turn._finish(_suspension_of(agent))
        if hub is not None:
            hub.close()
        return
    agent.pending = ()
    agent.set_state(host, AgentState.AWAITING_INPUT)
    _measure(agent)
    if turn is not None:
        turn._finish(final)
    if hub is not None:
        hub.close()


def _suspension_of(agent: Agent) -> Suspended:
    ws = agent.ws
    if ws is not None:
        for event in reversed(ws.tail):
            if isinstance(event.body, Suspended):
                return event.body
    return Suspended(agent.pending)


def _answer_cancels(
    agent: Agent, took_effect: bool, error: BaseException | None = None
) -> None:
    cancels, agent.cancels = agent.cancels, None
    for future in cancels or ():
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
            future.exception()  # a caller that gave up must not leave "never retrieved"
        else:
            future.set_result(took_effect)


def _partial(agent: Agent) -> str:
    hub = agent.hub
    return "".join(hub.parts) if hub is not None else ""


async def abort_turn(
    agent: Agent,
    host: Host,
    reason: AbortReason,
    detail: str,
    partial: str,
    error: BaseException | None = None,
) -> None:
    """Log an Aborted for the current turn, then fail everyone waiting on it.

    The append comes first: if it fails (the store is down) nothing changed here
    and the caller decides what that means.
    """
    if agent.ws is not None:
        await append(agent, host, [Aborted(reason, partial_text=partial, detail=detail)])
    turn = agent.current
    hub = agent.hub
    agent.current = None
    agent.hub = None
    agent.pending = ()
    aborted = TurnAborted(reason, partial, detail, error)
    if turn is not None:
        turn._fail(aborted)
    if hub is not None:
        hub.close(aborted)
    if agent.state not in (AgentState.AWAITING_INPUT, AgentState.PARKED, AgentState.STOPPED):
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
    try:
        await append(agent, host, [result, Resolved(request.call_id)])
    except StoreUnavailable as exc:
        fail(request, exc)  # nothing was written: still suspended on the same calls
        return
    agent.pending = tuple(c for c in agent.pending if c != request.call_id)
    if agent.pending:
        request.done.set_result(None)
        _measure(agent)
        return
    # The continuation is a new stream: the part before the suspension has ended.
    hub = StreamHub(host.followers(agent.id))
    agent.hub = hub
    agent.current = Turn(
        agent.id, agent.turn, _turn_start(ws, agent.turn), hub.join(), continuation=True
    )
    agent.calls = 0
    if not request.done.done():
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


async def _handle_card(agent: Agent, host: Host, request: CardRequest) -> None:
    """Log a task card change (see torpor.actors.task); bad input fails only the caller."""
    if request.done.done():
        return
    try:
        with anyio.CancelScope(shield=True):  # written and answered, or neither
            events = await logged(
                agent, host, card_change(agent, request.patch), turn=lambda: agent.turn
            )
    except (StoreUnavailable, ValueError, TypeError) as exc:
        fail(request, exc)  # nothing was written; the agent is fine
        return
    except Exception as exc:
        fail(request, exc)
        raise  # a conflict: our view of the log is stale, revive from it
    request.done.set_result(events[0])


async def _handle_cancel(agent: Agent, host: Host, request: CancelRequest) -> None:
    if agent.state is not AgentState.SUSPENDED:
        request.done.set_result(False)
        return
    try:
        await abort_turn(agent, host, "cancelled", "suspended turn cancelled by caller", "")
    except StoreUnavailable as exc:
        fail(request, exc)  # nothing was written: still suspended
        return
    request.done.set_result(True)
