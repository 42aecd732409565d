"""The actor's task body: revive, read the mailbox in every state, run turns, hibernate.

One asyncio task per live conversation, owned by the runtime's supervisor, and
the only code that changes the agent's state: callers post requests to its
mailbox and await the reply. A turn runs as a child task the actor owns (its
``turn_task``), so the actor keeps reading its mailbox while the turn streams,
runs tools or suspends: it logs a message sent meanwhile (assigning its turn
number, in log order) and postpones its turn, cancels the turn, refuses an
answer the turn does not wait for. The task returns when hibernated (dropping
its caches) and raises when it crashes; the supervisor then starts the next
task with a :class:`Recovery`, which that task applies to the record before
anything else.

Input and turns: a user message is logged as soon as it is taken, whatever the
state. If no turn is open its turn starts at once; if one is open (streaming,
running tools, suspended on an approval) the new turn is *postponed*: it runs
when the open one ends, in arrival order, and the model sees it after that
turn (see :mod:`torpor.compaction.order`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from torpor.actors.aborts import report_abort, turn_aborted
from torpor.actors.agent import Waiting
from torpor.actors.branch import handle_spawn
from torpor.actors.mailbox import (
    CancelRequest,
    CardRequest,
    HibernateRequest,
    Message,
    RedactRequest,
    ResolveRequest,
    SendRequest,
    SpawnRequest,
    StopRequest,
    UnparkRequest,
)
from torpor.actors.observe import TurnInfo
from torpor.actors.redaction import carry_out, carry_out_deferred, defer, fail_deferred
from torpor.actors.resolution import approves, replayed_resolution
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
from torpor.errors import (
    AgentParked,
    IdempotencyConflict,
    RuntimeClosed,
    ScheduleGone,
    StoreUnavailable,
    TurnAborted,
    UnknownCall,
)
from torpor.events import (
    Aborted,
    AbortReason,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Suspended,
    ToolResult,
    Unparked,
    UserMessage,
    aborted_body,
    presented,
)

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host

__all__ = ["Recovery", "abort_turn", "fail", "replayed_turn", "run_agent"]


class Recovery:
    """What the previous task of an agent left to settle: applied by the next one first.

    ``error``: what the open turn's waiters get (its stream delivered text no
    event holds: that becomes ``unlogged``, owed to the log). ``drain``: the
    requests still in the mailbox fail with it too. ``park``: the cause, when
    the agent is to be parked. ``final``: the agent is done for (fenced, an
    unreadable log, the runtime stopping): every waiter fails and no restart
    follows. ``crash``: when the crash that counts towards parking happened.
    """

    __slots__ = ("crash", "drain", "error", "final", "park")

    def __init__(
        self,
        error: BaseException,
        *,
        drain: bool = False,
        park: str | None = None,
        final: bool = False,
        crash: float | None = None,
    ) -> None:
        self.error = error
        self.drain = drain
        self.park = park
        self.final = final
        self.crash = crash


async def run_agent(
    agent: Agent, host: Host, *, delay: float = 0.0, recovery: Recovery | None = None
) -> None:
    """The actor. ``delay``: restart backoff; ``recovery``: what the last task left."""
    try:
        if recovery is not None:
            if recovery.final and isinstance(recovery.error, RuntimeClosed):
                await _stop(agent, host)  # the runtime stops: as a running actor would
                return
            _recover(agent, host, recovery)
            if recovery.final:
                return
            if recovery.park is not None:
                await _park(agent, host, recovery.park)
        if delay > 0:
            await _backoff(agent, delay, recovery)
        await _serve(agent, host)
    except asyncio.CancelledError:
        # Shutdown, or the shard moved away: the open turn logs how it ended, postponed
        # turns are ended in the log as what their callers are told, the rest is refused.
        await _stop(agent, host)
        raise
    except BaseException:
        # The actor crashed with a turn running: that turn ends with it (logged as
        # crashed by itself), never left writing beside the actor that replaces this one.
        await _end_turn_task(agent, _CRASHED)
        raise
    finally:
        agent.waiter = None


_CRASHED = "torpor: the actor crashed"  # the cancel message a turn's task is stopped with


async def _end_turn_task(agent: Agent, why: str | None = None) -> None:
    """Cancel the running turn's task (it logs its own end) and wait for it to finish."""
    task = agent.turn_task
    if task is not None and not task.done():
        task.cancel(why)
    if task is not None:
        with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
            await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved: the turn logged (or could not log) its end
    agent.turn_task = None


async def _backoff(agent: Agent, delay: float, recovery: Recovery | None) -> None:
    """Wait ``delay`` before running again. While the store cannot write, mail cuts the
    wait short: the request is tried at once, and refused at once if the store still
    refuses (its caller learns in one attempt's time, never after a backoff)."""
    store_down = recovery is not None and isinstance(recovery.error, StoreUnavailable)
    if not store_down:
        await anyio.sleep(delay)
        return
    if agent.has_work():
        return
    loop = asyncio.get_running_loop()
    waiter = agent.waiter = loop.create_future()
    timer = loop.call_later(delay, agent.wake)
    try:
        await waiter
    finally:
        timer.cancel()
        agent.waiter = None


async def _serve(agent: Agent, host: Host) -> None:
    while True:
        if agent.state is AgentState.PARKED:
            unpark = agent.mailbox.take_unpark() if agent.mailbox is not None else None
            if unpark is None:
                _refuse_all(agent)
                _drop_caches(agent)
                return
            await _unpark(agent, host, unpark)
            continue
        turn_task = agent.turn_task
        if turn_task is not None and turn_task.done():
            agent.turn_task = None  # it crashed (one that ended well let go of itself)
            try:
                turn_task.result()
            except _TurnCrashed as crashed:
                crashed.settle()  # its waiters learn of it as the supervisor does
                raise crashed.crash from None
            continue
        if turn_task is None and agent.redactions:  # taken while a turn ran: now
            await carry_out_deferred(agent, host, revive)
            continue
        if agent.ws is None and (agent.has_work() or agent.runnable_postponed()
                                 or agent.state is AgentState.REVIVING):
            await revive(agent, host)  # eager after a restart: it proves the log reads back
            continue
        if turn_task is None and agent.postponed and agent.state is AgentState.AWAITING_INPUT:
            _start_postponed(agent, host)
            _start_turn(agent, host)
            continue
        # Not kept while waiting: a finished turn's task (and its frame's objects) would
        # stay alive with every idle agent that last ran one.
        turn_task = None
        message = agent.next_message()
        if message is None:
            # Awaited here, not through a helper coroutine: one frame less per idle
            # agent for the cyclic GC to walk. A post and a turn's end resolve it.
            waiter = agent.waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                agent.waiter = None
            continue
        if isinstance(message, StopRequest):
            agent.post(message)  # read before its cancel landed: stop as if it had
            await _stop(agent, host)
            return
        if isinstance(message, HibernateRequest):
            idle = _idle(agent)
            if message.done is not None and not message.done.done():
                message.done.set_result(idle)
            if idle:
                host.on_hibernated(agent)  # reported while the record still shows its state
                _drop_caches(agent)
                if agent.mailbox is not None:  # others asked too: it is done for them as well
                    for other in agent.mailbox.drain():
                        if isinstance(other, HibernateRequest) and other.done is not None:
                            _answer(other.done, True)
                    agent.mailbox = None
                return
            continue
        agent.taken = message  # left set if cancelled: the task's stop answers it
        if isinstance(message, SendRequest):
            # This frame must not keep the request while the turn runs (its commits
            # may wait behind thousands of others: one more object for the GC each).
            send = _handle_send(agent, host, message)
            message = None
            await send
            del send
        elif isinstance(message, CancelRequest):
            await _handle_cancel(agent, host, message)
        elif isinstance(message, CardRequest):
            await _handle_card(agent, host, message)  # mid-turn: in effect from its next call
        elif isinstance(message, UnparkRequest):
            if not message.done.done():
                message.done.set_result(False)  # not parked (any more)
        elif isinstance(message, RedactRequest):
            if agent.turn_task is not None:
                defer(agent, message)  # after the turn: no fold of it may copy the text
            else:
                await carry_out(agent, host, message, revive)
        elif agent.turn_task is not None:
            # An answer or a spawn while the turn runs: it waits for no call until it
            # suspends (answer the ids of the Suspended that ends its stream). A keyed
            # answer may be the retry of the one that started this turn.
            if isinstance(message, ResolveRequest) and message.key is not None:
                await _replay_resolve(agent, host, message)
            else:
                _refuse_call(agent, message)
        elif isinstance(message, ResolveRequest):
            await _handle_resolve(agent, host, message)
        elif isinstance(message, SpawnRequest):
            await handle_spawn(agent, host, message)
        agent.taken = None
        agent.last_active = time.monotonic()
        if agent.turn_task is None:  # a turn it started says so itself when it ends
            host.on_idle(agent)


def _idle(agent: Agent) -> bool:
    """Nothing to do but wait: no turn open to run, nothing in the mailbox."""
    return (
        agent.turn_task is None
        and not agent.has_work()
        and not agent.runnable_postponed()
        and agent.state in (AgentState.AWAITING_INPUT, AgentState.SUSPENDED)
    )


def _start_turn(agent: Agent, host: Host) -> None:
    """Run the current turn as the actor's child; its end wakes the actor."""
    # No done callback: a turn that ends well lets go of itself (``_turn_over``) and
    # wakes the actor only when postponed turns wait; one that fails wakes it to collect.
    agent.turn_task = asyncio.get_running_loop().create_task(_run_turn(agent, host))


def _refuse_call(agent: Agent, message: Message) -> None:
    call_id = getattr(message, "call_id", "")
    fail(message, UnknownCall(f"{agent.id}: not waiting for tool call {call_id!r}"))


def _drop_caches(agent: Agent) -> None:
    agent.ws = None
    agent.recent = None
    agent.hub = None
    agent.lock = None
    agent.ws_tokens = 0
    agent.ws_bytes = 0


def _refuse_all(agent: Agent) -> None:
    """Parked: refuse what waits (a turn logged while it queued for a slot included)."""
    error = AgentParked(agent.id, agent.parked_cause or "parked")
    fail_deferred(agent, error)
    postponed, agent.postponed = agent.postponed, None
    for waiting in postponed or ():
        waiting.turn._fail(error)
        waiting.hub.close(error)
    mailbox = agent.mailbox
    agent.mailbox = None
    if mailbox is None:
        return
    for message in mailbox.drain():
        fail(message, error)


def _answer(future: asyncio.Future[Any], value: Any) -> None:
    """Answer a request, unless its caller gave up meanwhile (never a crash of the actor)."""
    if not future.done():
        future.set_result(value)


def fail(message: Message, error: BaseException) -> None:
    """Complete a request's future with ``error`` (if nobody completed it yet)."""
    if isinstance(message, HibernateRequest):
        if message.done is not None and not message.done.done():
            message.done.set_result(False)  # not hibernated: the agent did not get to it
        return
    if isinstance(message, StopRequest):
        return
    if isinstance(message, UnparkRequest) and isinstance(error, AgentParked):
        if not message.done.done():
            message.done.set_result(False)  # parked again before it was read: not unparked
        return
    future: asyncio.Future[object]
    future = message.accepted if isinstance(message, SendRequest) else message.done  # type: ignore[assignment]
    if not future.done():
        future.set_exception(error)
        future.exception()  # a caller that gave up must not leave "never retrieved"


def _fail_waiting(agent: Agent, error: BaseException, *, postponed: bool = True) -> None:
    """Complete every request waiting on this agent with ``error``; with ``postponed``,
    its postponed turns too (they are in the log: they run when the agent next runs)."""
    taken, agent.taken = agent.taken, None
    if taken is not None:
        fail(taken, error)  # no-op if it was answered
    fail_deferred(agent, error)
    mailbox = agent.mailbox
    agent.mailbox = None
    for message in mailbox.drain() if mailbox is not None else ():
        fail(message, error)
    if not postponed:
        return
    waiting, agent.postponed = agent.postponed, None
    if isinstance(error, AgentParked | RuntimeClosed):
        reason = "shutdown" if isinstance(error, RuntimeClosed) else "crashed"
        error = TurnAborted(reason, "", str(error))
    for entry in waiting or ():
        entry.turn._fail(error)


def _recover(agent: Agent, host: Host, recovery: Recovery) -> None:
    """Settle what the last task left: fail the open turn's waiters, drop the caches."""
    error = recovery.error
    if not isinstance(error, RuntimeClosed):
        agent.last_error = (
            error.detail if isinstance(error, TurnAborted) and error.detail
            else f"{type(error).__name__}: {error}"
        )
    if isinstance(error, StoreUnavailable):
        agent.store_failures += 1  # its own backoff: not a crash
    if recovery.crash is not None:
        window = host.restart_window
        agent.crash_times = (
            *(t for t in agent.crash_times if recovery.crash - t < window), recovery.crash
        )
        if recovery.park is None:
            agent.restarts += 1
    current, agent.current = agent.current, None
    if current is not None:
        current._fail(error)
    hub, agent.hub = agent.hub, None
    if hub is not None:
        agent.unlogged = "".join(hub.parts)  # streamed, not logged: still owed
        hub.close(error)
    cancels, agent.cancels = agent.cancels, None
    for future in cancels or ():
        if not future.done():
            future.set_result(False)  # the turn was not cancelled: it broke
    agent.scope = None
    agent.cancellable = False
    agent.turn_task = None
    taken, agent.taken = agent.taken, None
    if taken is not None:
        fail(taken, error)
    agent.ws = None  # the log is the memory: the restart reads it back
    agent.recent = None
    agent.lock = None
    host.on_dropped(agent)
    if recovery.drain or recovery.final:
        # Store down: requests not yet taken could only fail the same way now, while
        # postponed turns are in the log and run once it writes again.
        _fail_waiting(agent, error, postponed=recovery.final)
        if not recovery.final and isinstance(error, StoreUnavailable) and agent.postponed:
            # Their turns cannot run before the log ends the one that broke: their callers
            # learn why now, not when the store writes again (they run then).
            blocked = StoreUnavailable(
                f"{agent.id}: a turn before this one could not be logged ({error}); this"
                " turn is logged and runs once the store writes again"
            )
            for waiting in agent.postponed:
                waiting.turn._block(blocked)
    if recovery.final:
        if isinstance(error, RuntimeClosed):
            agent.set_state(host, AgentState.STOPPED)
        else:
            agent.report(host, AgentState.EVICTED)
    elif recovery.park is None:
        agent.set_state(host, AgentState.REVIVING)


async def _park(agent: Agent, host: Host, cause: str) -> None:
    """Crashed too often: refuse input from now on, durably (logged as ``Parked``)."""
    agent.parked_cause = cause
    agent.set_state(host, AgentState.PARKED)
    _fail_waiting(agent, AgentParked(agent.id, cause))
    try:
        with anyio.CancelScope(shield=True):
            events = await host.store.append_events(
                agent.id, [Parked(cause, restarts=agent.restarts)], turn=agent.turn
            )
        agent.head = max(agent.head, events[-1].position)
        host.publish(agent, events)
    except Exception as exc:  # the store may be what keeps failing: stay parked in memory
        with contextlib.suppress(Exception):
            host.log.error("parking_not_logged", conversation_id=agent.id, error=repr(exc))
    with contextlib.suppress(Exception):
        host.log.error("agent_parked", conversation_id=agent.id, cause=cause,
                       restarts=agent.restarts)


async def _unpark(agent: Agent, host: Host, request: UnparkRequest) -> None:
    """Log ``Unparked``, then revive from the log (which no longer says parked)."""
    try:
        with anyio.CancelScope(shield=True):  # written and answered, or neither
            events = await host.store.append_events(agent.id, [Unparked()], turn=agent.turn)
    except Exception as exc:
        fail(request, exc)
        return
    agent.head = max(agent.head, events[-1].position)
    host.publish(agent, events)
    agent.parked_cause = None
    agent.crash_times = ()
    _drop_caches(agent)
    agent.set_state(host, AgentState.REVIVING)
    if not request.done.done():
        request.done.set_result(True)


async def _stop(agent: Agent, host: Host) -> None:
    """The task is being stopped: the runtime leaves, or the conversation moved away.

    Leaving: the open turn logs how it ended, postponed turns behind it are ended in
    the log as what their callers are told (behind a suspension they stay, and run
    once it is answered, after a restart too), the rest is refused. Moved (a ``StopRequest``
    in the mailbox): everything waiting fails with its error and nothing more is
    logged here; the new owner runs the logged turns.
    """
    moved = None if agent.mailbox is None else agent.mailbox.take_stop()
    # Behind a suspension, postponed turns wait for its answer, which survives a restart
    # in the log: they run after it then. Behind a running turn (or none), they are ended
    # in the log as their callers are told.
    behind_suspension = agent.state is AgentState.SUSPENDED
    if moved is not None:
        current, agent.current = agent.current, None
        if current is not None:
            current._fail(moved)  # before its turn's own end: the caller learns where it went
    await _end_turn_task(agent)  # it logs Aborted("shutdown") for itself, shielded
    current, agent.current = agent.current, None
    hub, agent.hub = agent.hub, None
    unended = current is not None or hub is not None  # its end could not be logged
    if unended:
        stopped = moved or TurnAborted("shutdown", _partial_of(hub), "runtime stopped")
        if current is not None:
            current._fail(stopped)
        if hub is not None:
            hub.close(stopped)
    if moved is not None:
        _fail_waiting(agent, moved)
        _drop_caches(agent)
        agent.report(host, AgentState.EVICTED)
        return
    postponed, agent.postponed = agent.postponed, None
    error = RuntimeClosed("the runtime stopped")
    if (postponed and not behind_suspension and agent.state is not AgentState.PARKED
            and host.draining):
        # Their callers are told "shutdown": the log says the same, so nothing is left
        # half-done for the next run to report as interrupted. Turns end in the log in turn
        # order (the open-work index counts on it: store.open_work), so an open turn whose
        # own end could not be logged is ended first.
        ends = [(agent.turn, aborted_body("shutdown", _partial_of(hub), "runtime stopped"))
                ] if unended else []
        ends += [(waiting.event.turn, aborted_body("shutdown", detail="runtime stopped "
                                                   "before this postponed turn ran"))
                 for waiting in postponed]
        for number, aborted in ends:
            try:
                with anyio.CancelScope(shield=True):
                    await logged(agent, host, [aborted], turn=number)
            except Exception:
                break  # the store refuses: the next run reports it as interrupted
            report_abort(host.log, host.observers, agent.id, number, aborted)
    for waiting in postponed or ():
        waiting.turn._fail(TurnAborted("shutdown", "", str(error)))
        waiting.hub.close()
    _fail_waiting(agent, error)


async def revive(agent: Agent, host: Host) -> None:
    """Rebuild the working set from the latest checkpoint plus events since: one store trip."""
    if agent.state is not AgentState.REVIVING:
        agent.set_state(host, AgentState.REVIVING)
    started = time.perf_counter()
    # A queued conversation's messages are logged by the admission queue under this
    # lock until its actor runs: reading under it, the revival sees each one whole.
    lock = agent.lock
    if lock is None:
        lock = WriteLock()
    async with lock, host.revival_slot():
        resume = await host.store.resume(agent.id)
    # Turns this record holds handles for were postponed, even where the turn before
    # them had ended (a conversation that queued for a slot): they run, not abort.
    held = frozenset(w.event.position for w in agent.postponed) if agent.postponed else None
    events = [presented(e) for e in resume.events]  # a redacted one as the model sees it
    restored = restore(events, postponed=held)
    ws = WorkingSet(agent.id, resume.checkpoint, up_to_turn(events, restored.turn))
    agent.ws = ws
    agent.lock = lock
    agent.head = resume.head if resume.head is not None else -1
    agent.recent = None  # what followers may replay from memory starts at this head
    agent.turn = restored.turn
    agent.numbered = restored.numbered
    agent.cycle = resume.checkpoint.cycle if resume.checkpoint is not None else 0
    agent.pending = restored.pending
    agent.parked_cause = restored.parked_cause
    _adopt_postponed(agent, host, restored.postponed)
    if restored.unfinished and restored.state is not AgentState.PARKED:
        # The turn died mid-way (the process, or the store): the log must say so before
        # anything else happens, with the text its stream had delivered.
        cut = aborted_body("interrupted", agent.unlogged, "found unfinished on revival")
        await append(agent, host, [cut])
        report_abort(host.log, host.observers, agent.id, agent.turn, cut)
    agent.unlogged = ""
    agent.store_failures = 0
    for waiting in agent.postponed or ():
        waiting.turn._block(None)  # the store writes again: postponed turns will run
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


async def _handle_send(agent: Agent, host: Host, request: SendRequest) -> None:
    """Log the request's message with the next turn number; start its turn or postpone it.

    The actor alone logs user messages, one at a time, so a number is taken once:
    the last logged (postponed ones included) plus one, in log order.
    """
    if request.accepted.done():  # the caller gave up before its turn came
        return
    # A turn is open (running, suspended on an approval, or others wait): run it after.
    behind = (agent.turn_task is not None or agent.state is not AgentState.AWAITING_INPUT
              or bool(agent.postponed))
    number = agent.last_turn() + 1
    try:
        # No shield: no cancel scope encloses the actor here, and the runtime stops its
        # actors with Task.cancel, which no scope holds back.
        fired = request.fired
        scheduled = None if fired is None else fired.schedule_id
        events = await logged(
            agent, host, [UserMessage(request.text, request.metadata, scheduled)], turn=number,
            key=request.key, fired=fired,
        )
    except (StoreUnavailable, ScheduleGone) as exc:  # nothing written: the agent is fine
        fail(request, exc)
        return
    except Exception as exc:
        # A conflict means someone else wrote this conversation: our view is stale, so
        # fail the send and crash; the supervisor revives us from the log.
        fail(request, exc)
        if isinstance(exc, ValueError | TypeError):
            return  # bad input: nothing was written, the agent is fine
        raise
    event = events[0]
    if event.turn != number:  # an idempotent retry of an earlier send
        turn = await replayed_turn(agent, host, event.position, event.turn)
    elif behind:
        hub = StreamHub(host.followers(agent.id))
        turn = Turn(agent.id, number, event.position, hub.join(), postponed=True)
        turn.origin = request.origin
        if agent.postponed is None:
            agent.postponed = []
        agent.postponed.append(Waiting(event, turn, hub))
        host.log.debug("postponed", conversation_id=agent.id, turn=number,
                       position=event.position)
    else:
        ws = agent.ws
        assert ws is not None
        ws.append(events)
        agent.turn = number
        agent.calls = 0
        hub = StreamHub(host.followers(agent.id))
        agent.hub = hub
        turn = agent.current = Turn(agent.id, number, event.position, hub.join())
        turn.origin = request.origin
        _start_turn(agent, host)
    if not request.accepted.done():
        request.accepted.set_result(turn)


def _start_postponed(agent: Agent, host: Host) -> None:
    """Make the first postponed turn the current one (``_start_turn`` runs it)."""
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
    for stored in await host.store.read_since(agent.id, position + 1):
        event = presented(stored)
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
        turn._fail(turn_aborted(aborted) if aborted is not None else TurnAborted("interrupted"))
    return turn


async def _run_turn(agent: Agent, host: Host) -> None:
    """Run (or continue) the current turn; every way it can end is logged."""
    observers = host.observers
    current = agent.current
    if not observers or current is None:
        await _run_turn_now(agent, host)
        return
    info = TurnInfo(agent.id, agent.turn, current.continuation, current.postponed)
    with observers.turn(info, current.origin):
        await _run_turn_now(agent, host)


async def _run_turn_now(agent: Agent, host: Host) -> None:
    try:
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
                    final = await run_steps(agent, host)
                except ModelFailed as exc:
                    reason, detail, partial = "model_error", str(exc), exc.partial
                    model_error = exc.cause
                except StepLimit as exc:
                    reason, detail = "step_limit", str(exc)
            if turn_scope.cancelled_caught:
                reason, detail = "cancelled", "cancelled by caller"
        except anyio.get_cancelled_exc_class() as stopped:
            crashed = _CRASHED in stopped.args
            try:
                with anyio.CancelScope(shield=True):
                    await abort_turn(
                        agent, host, "crashed" if crashed else "shutdown",
                        "the actor crashed" if crashed else "runtime stopped", _partial(agent),
                    )
            finally:
                _answer_cancels(agent, not crashed)
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
            settle = None
            try:
                settle = await abort_turn(
                    agent, host, reason, detail, partial, model_error, settle=crash is None
                )
            except Exception as exc:
                # The abort is not in the log, so no cancel took effect: its callers get the
                # error (a cancel is True only once the log ends the turn with it).
                _answer_cancels(agent, False, exc)
                if crash is None:
                    raise
            else:
                _answer_cancels(agent, reason == "cancelled")
            if crash is not None:
                if settle is None:
                    raise crash  # nothing logged: the next task fails the waiters
                raise _TurnCrashed(crash, settle)
            _turn_over(agent, host)
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
            _turn_over(agent, host)
            return
        agent.pending = ()
        agent.set_state(host, AgentState.AWAITING_INPUT)
        _measure(agent)
        if turn is not None:
            turn._finish(final)
        if hub is not None:
            hub.close()
        _turn_over(agent, host)
    except BaseException:
        agent.wake()  # the actor collects a turn that did not let go of itself
        raise


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
    return _partial_of(agent.hub)


def _partial_of(hub: StreamHub | None) -> str:
    return "".join(hub.parts) if hub is not None else ""


async def abort_turn(
    agent: Agent,
    host: Host,
    reason: AbortReason,
    detail: str,
    partial: str,
    error: BaseException | None = None,
    *,
    settle: bool = True,
) -> Callable[[], None]:
    """Log an Aborted for the current turn, then fail everyone waiting on it.

    The append comes first: if it fails (the store is down) nothing changed here
    and the caller decides what that means. ``settle=False``: the waiters are
    failed by the returned function instead (a crashed turn: its actor settles
    them as it reports the crash, so a caller learns of it after the runtime).
    """
    body = aborted_body(reason, partial, detail, error)
    if agent.ws is not None:
        await append(agent, host, [body])
    report_abort(host.log, host.observers, agent.id, agent.turn, body, error)
    turn = agent.current
    hub = agent.hub
    agent.current = None
    agent.hub = None
    agent.pending = ()
    aborted = turn_aborted(body, error)

    def fail_waiters() -> None:
        if turn is not None:
            turn._fail(aborted)
        if hub is not None:
            hub.close(aborted)

    if settle:
        fail_waiters()
    if agent.state not in (AgentState.AWAITING_INPUT, AgentState.PARKED, AgentState.STOPPED):
        agent.set_state(host, AgentState.AWAITING_INPUT)
    _measure(agent)
    return fail_waiters


class _TurnCrashed(Exception):
    """A turn's task ended by a crash, its abort logged; its waiters are failed by
    ``settle`` when the actor reports the crash."""

    def __init__(self, crash: BaseException, settle: Callable[[], None]) -> None:
        super().__init__(str(crash))
        self.crash = crash
        self.settle = settle


def _turn_over(agent: Agent, host: Host) -> None:
    """The turn's task is done with the turn: the agent is idle before its caller resumes."""
    if agent.turn_task is not asyncio.current_task():
        return  # not the actor's turn any more (the actor stopped it): nothing to report
    agent.turn_task = None
    agent.last_active = time.monotonic()
    host.on_idle(agent)
    if agent.postponed or agent.redactions:
        agent.wake()  # the actor starts the next one, or redacts


async def _replay_resolve(agent: Agent, host: Host, request: ResolveRequest) -> None:
    """A keyed answer to a call not waited for: the retry of one logged under its key gets
    that one's outcome; anything else is refused (UnknownCall, IdempotencyConflict)."""
    ws = agent.ws
    assert ws is not None and request.key is not None
    try:
        found, outcome = await replayed_resolution(
            agent, host, request, functools.partial(_turn_start, ws)
        )
    except Exception as exc:  # a conflict, or the log unreadable: the caller's, not ours
        fail(request, exc)
        return
    if found:
        _answer(request.done, outcome)
    else:
        _refuse_call(agent, request)


async def _handle_resolve(agent: Agent, host: Host, request: ResolveRequest) -> None:
    if agent.state is not AgentState.SUSPENDED or request.call_id not in agent.pending:
        if request.key is not None:  # answered already, maybe by this very request
            await _replay_resolve(agent, host, request)
        else:
            _refuse_call(agent, request)
        return
    ws = agent.ws
    assert ws is not None
    bodies: list[Body]
    if request.call_id in _suspension_of(agent).approvals and approves(
        request.content, request.is_error
    ):
        # Approved: logged alone; the continuation runs the call and logs its result.
        bodies = [Resolved(request.call_id, approval=request.content)]
    else:  # an answer, or an approval refused: what the model reads for the call
        tool = _tool_name(ws, request.call_id)
        result = ToolResult(request.call_id, tool, request.content, is_error=request.is_error)
        bodies = [result, Resolved(request.call_id)]
    try:
        await append(agent, host, bodies, key=request.key)
    except (StoreUnavailable, IdempotencyConflict) as exc:
        fail(request, exc)  # nothing was written: still suspended on the same calls
        return
    agent.pending = tuple(c for c in agent.pending if c != request.call_id)
    if agent.pending:
        _answer(request.done, None)
        _measure(agent)
        return
    # The continuation is a new stream: the part before the suspension has ended.
    hub = StreamHub(host.followers(agent.id))
    agent.hub = hub
    agent.current = Turn(
        agent.id, agent.turn, _turn_start(ws, agent.turn), hub.join(), continuation=True
    )
    agent.current.origin = request.origin
    # The same turn goes on: its model calls (the audit's call_index, the max_steps limit)
    # keep counting, read from the log so that a revival in between changes nothing.
    agent.calls = _calls_in_turn(ws, agent.turn)
    if not request.done.done():
        request.done.set_result(agent.current)
    _start_turn(agent, host)


def _tool_name(ws: WorkingSet, call_id: str) -> str:
    for event in reversed(ws.tail):
        body = event.body
        if isinstance(body, AssistantMessage):
            for call in body.tool_calls:
                if call.id == call_id:
                    return call.name
    return "external"


def _calls_in_turn(ws: WorkingSet, turn: int) -> int:
    """The model calls turn ``turn`` has made so far: each that did not end the turn logged
    one assistant message. A fold never cuts into the current turn (it keeps at least that
    one verbatim), so all of them are in the tail, after a revival as well."""
    calls = 0
    for event in reversed(ws.tail):  # turn order: the turn's events are the last ones
        if event.turn < turn:
            break
        if event.turn == turn and isinstance(event.body, AssistantMessage):
            calls += 1
    return calls


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
    _answer(request.done, events[0])


async def _handle_cancel(agent: Agent, host: Host, request: CancelRequest) -> None:
    """Stop the open turn: running (through its scope), or suspended (logged here)."""
    if agent.turn_running:
        if agent.cancels is None:
            agent.cancels = []
        agent.cancels.append(request.done)  # answered when the turn ends: True or too late
        scope = agent.scope
        if agent.cancellable and scope is not None:
            scope.cancel()
        # Not interruptible right now (committing, folding): the turn checks its cancels
        # when it next may be interrupted, or ends first and the cancel is too late.
        return
    if agent.state is not AgentState.SUSPENDED:
        _answer(request.done, False)
        return
    try:
        await abort_turn(agent, host, "cancelled", "suspended turn cancelled by caller", "")
    except StoreUnavailable as exc:
        fail(request, exc)  # nothing was written: still suspended
        return
    _answer(request.done, True)
