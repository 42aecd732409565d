"""One turn's steps: fold if over budget, render, stream the model, log, run tools, repeat.

The user message is already durable when a turn starts. Every step ends with
something logged, so a turn that dies at any point leaves a log that says how
far it got (the caller then logs the ``Aborted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import msgspec

from torpor.actors.observe import UNWATCHED, FoldInfo, ModelCallInfo, ToolCallInfo
from torpor.actors.schedule_tool import SCHEDULE_TOOL, run_schedule_tool
from torpor.actors.scopes import scope
from torpor.actors.state import AgentState
from torpor.actors.task import card_change, pushed_for, tool_patch
from torpor.actors.tool_calls import checked_call
from torpor.actors.tools import ExternalTool, LocalTool, run_tool
from torpor.actors.turn_context import context_for
from torpor.actors.watchdog import Call
from torpor.compaction import FoldPlan, Rendered, build_checkpoint, encode_recipe, plan_fold
from torpor.compaction.anatomy import anatomy
from torpor.compaction.push import NOTHING, Pushed
from torpor.compaction.recall import (
    EXPAND_PAGE_CHARS,
    EXPAND_TOOL,
    RECALL_TOOL,
    expand,
    format_events,
    format_hits,
)
from torpor.compaction.recall import recall as recall_hits
from torpor.compaction.task_card import TASK_CARD_TOOL
from torpor.errors import (
    InvalidInput,
    ModelContextTooLong,
    ModelError,
    ModelTimeout,
    StoreError,
    ToolArgumentError,
)
from torpor.events import AssistantMessage, Body, Event, Suspended, TaskCard, ToolCall, ToolResult
from torpor.llm.protocol import (
    CONTEXT_TOKENS,
    CONVERSATION,
    Model,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from torpor.mcp.calls import approved_calls, run_approved_calls, run_mcp
from torpor.memory.fold import fold_memory
from torpor.memory.reconcile import reconcile_logged
from torpor.store.protocol import ModelCall
from torpor.text import repair_text

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host
    from torpor.store.schedules import Firing

__all__ = [
    "BUILTIN_TOOLS", "ModelFailed", "StepLimit", "append", "logged", "run_approved", "run_steps"
]

BUILTIN_TOOLS = {RECALL_TOOL.name: RECALL_TOOL, EXPAND_TOOL.name: EXPAND_TOOL}


class ModelFailed(Exception):
    """The model raised mid-stream; ``partial`` is the text it had streamed."""

    def __init__(self, cause: BaseException, partial: str) -> None:
        advice = f"; {cause.advice}" if isinstance(cause, ModelError) else ""
        super().__init__(f"{type(cause).__name__}: {cause}{advice}")
        self.cause = cause
        self.partial = partial


class StepLimit(Exception):
    """The model kept calling tools past ``max_steps``."""


async def append(
    agent: Agent, host: Host, bodies: Sequence[Body], *, key: str | None = None
) -> list[Event]:
    """Log bodies for the current turn, expecting our own head (a second writer conflicts).

    Shielded: a cancel that landed mid-append could leave the row written but our
    head stale; a cancel takes effect at the next model or tool await instead.
    ``key``: an idempotency key the bodies are logged under (an outside answer's).
    """
    with scope(shield=True):
        events = await logged(agent, host, bodies, turn=agent.turn, key=key, apply=True)
    return events


async def logged(
    agent: Agent,
    host: Host,
    bodies: Sequence[Body] | Callable[[], Sequence[Body]],
    *,
    turn: int | Callable[[], int],
    key: str | None = None,
    audit: ModelCall | None = None,
    apply: bool = False,
    fired: Firing | None = None,
) -> list[Event]:
    """Append at our head, one writer at a time, and tell the followers.

    The one place an agent's appends go through: the lock orders the actor's own
    writes with a message logged mid-turn by the sender's task. ``turn`` may be
    a function, read once the lock is held (a postponed message's number);
    ``bodies`` too (a task card change, merged with the card in effect under the
    lock, so two changes never overwrite each other).

    ``apply``: the events join the working set and the turn's stream here (the
    actor's own writes for its current turn). ``audit``: the model call that
    produced ``bodies``, written by the same operation (the store's
    ``_append_audited``: one commit; a conflicting answer still leaves the call's
    row), or,
    with a store without it, queued right behind them with no await between and
    awaited once the working set and the stream are up to date, so a follower
    arriving in between never sees the answer in the log and its text still in
    flight. One coroutine for all of it: each frame a waiting
    write holds is one more object per turn in flight for the cyclic GC to walk.
    """
    lock = agent.lock  # taken by hand, not by a coroutine of its own: one frame less per write
    if lock is not None and not lock.try_acquire():  # free almost always: no coroutine
        await lock.acquire()
    recording: asyncio.Future[None] | None = None
    sealing = agent.hub if apply else None  # under the lock: no other write is unapplied
    if sealing is not None:
        sealing.sealing = True
    try:
        number = turn if isinstance(turn, int) else turn()
        if callable(bodies):
            bodies = bodies()
        store = host.store
        # One operation for the answer and its audit row where the store has it (both
        # backends: one future and one plan less per call); else two, queued together.
        audited = (
            getattr(store, "_append_audited", None) if audit is not None and key is None else None
        )
        if audit is not None and audited is None:
            recording = asyncio.ensure_future(store.record_model_call(audit))
        try:
            events: list[Event]
            if audited is not None:
                events = await audited(agent.id, bodies, number, agent.head, audit)
            elif fired is not None:  # a schedule's firing: it moves in the same transaction
                events = await store.append_events(
                    agent.id, bodies, turn=number, expect_head=agent.head, fired=fired
                )
            else:
                events = await store.append_events(
                    agent.id, bodies, turn=number, expect_head=agent.head, key=key
                )
        except BaseException:  # both have finished either way: nothing is left running
            if recording is not None:
                await asyncio.wait((recording,))
                if not recording.cancelled():
                    recording.exception()  # retrieved: the append's own error is raised
            raise
        fresh = events[-1].position > agent.head  # else a key found what it logged before
        if fresh:
            agent.head = events[-1].position
            host.publish(agent, events)
            ws = agent.ws
            if ws is not None:  # a card is in effect from the next model call on
                for event in events:
                    if type(event.body) is TaskCard:
                        ws.note_card(event)
            reconciler = agent.profile.config.reconciler
            if reconciler is not None:  # the hot-path reconciler, once per finished turn
                await reconcile_logged(host.store, reconciler, agent.id, number, ws, events)
        if apply and fresh:
            ws = agent.ws
            assert ws is not None
            ws.append(events)
            hub = agent.hub
            if hub is not None:
                for event in events:
                    hub.logged(event)
    finally:
        if sealing is not None:
            sealing.sealing = False
        if lock is not None:
            lock.release()
    if recording is not None:
        await recording
    return events


async def run_steps(agent: Agent, host: Host) -> AssistantMessage | None:
    """Run model calls until an answer without tool calls (returned) or a suspension (None)."""
    profile = agent.profile
    config = profile.config
    if profile.mcp is not None:  # a continuation after approvals: those calls run first
        await run_approved(agent, host)
    while True:
        if agent.calls >= config.max_steps:
            raise StepLimit(f"more than {config.max_steps} model calls in one turn")
        agent.calls += 1
        plan = _fold_plan(agent)
        if plan is not None:  # most calls fold nothing: no coroutine for them
            await _fold(agent, host, plan)
        try:
            message = await _call_model(agent, host)
        except ModelFailed as exc:
            if not isinstance(exc.cause, ModelContextTooLong) or exc.partial:
                raise
            # The provider counted more than fits: fold once (forced) and retry once.
            agent.compact_requested = True
            plan = _fold_plan(agent)
            if plan is not None:
                await _fold(agent, host, plan)
            message = await _call_model(agent, host)
        if not message.tool_calls:
            return message
        agent.set_state(host, AgentState.RUNNING_TOOLS)
        approvals: list[str] = []
        external = await _run_tools(agent, host, message.tool_calls, approvals)
        if external:
            names = tuple(c.name for c in message.tool_calls if c.id in external)
            await append(agent, host, [_suspension(external, names, tuple(approvals))])
            agent.pending = external
            return None


async def run_approved(agent: Agent, host: Host) -> None:
    """Run the calls of this turn approved since it suspended and log their results
    (a continuation's first step; nothing to do on most turns)."""
    ws = agent.ws
    mcp = agent.profile.mcp
    assert ws is not None and mcp is not None
    calls = approved_calls(ws.tail, agent.turn)
    if not calls:
        return
    agent.set_state(host, AgentState.RUNNING_TOOLS)
    agent.cancellable = True  # a cancel stops the calls (the server is told)
    try:
        if agent.cancels:
            _cancel_turn(agent)
        done = await run_approved_calls(calls, mcp, agent.profile.config.tool_timeout)
    finally:
        agent.cancellable = False
    await append(agent, host, done)


def _fold_plan(agent: Agent) -> FoldPlan | None:
    """What to fold before the next call, if the working set is over its trigger (or a
    fold was asked for)."""
    ws = agent.ws
    assert ws is not None
    plan = plan_fold(
        ws, agent.profile.policy, force=agent.compact_requested, calibration=agent.calibration
    )
    agent.compact_requested = False
    return plan


async def _fold(agent: Agent, host: Host, plan: FoldPlan) -> None:
    observers = host.observers
    if not observers:  # no observer: no FoldInfo made
        await _fold_now(agent, host, plan)
        return
    with observers.fold(FoldInfo(agent.id, agent.turn, agent.cycle + 1)):
        await _fold_now(agent, host, plan)


async def _fold_now(agent: Agent, host: Host, plan: FoldPlan) -> None:
    ws = agent.ws
    assert ws is not None
    profile = agent.profile
    started = time.perf_counter()
    summary = bundle = ""
    summarizer = profile.config.summarizer
    if summarizer is not None:
        previous = ws.checkpoint.summary if ws.checkpoint is not None else ""
        agent.cancellable = True  # a summarizer's model call is cancelled like the turn's
        try:
            if agent.cancels:
                _cancel_turn(agent)
            committed = ws.checkpoint.position if ws.checkpoint is not None else -1
            remembered = await fold_memory(host.store, summarizer, agent.id, previous, plan,
                                           committed)
        finally:
            agent.cancellable = False
        summary, audit, bundle = remembered.summary, remembered.audit, remembered.bundle
        if audit is not None:
            await _record(host, audit.model_call(
                agent.id, agent.turn, agent.calls, agent.cycle + 1, ws.checkpoint, profile.policy
            ))
    checkpoint = build_checkpoint(
        plan, ws.checkpoint, cycle=agent.cycle + 1, summary=summary, memory=bundle,
        task_card=ws.card,
    )
    with anyio.CancelScope(shield=True):  # written and applied, or neither
        await host.store.put_checkpoint(checkpoint)
    ws.apply(checkpoint)
    agent.cycle = checkpoint.cycle
    host.log.debug("folded", conversation_id=agent.id, position=checkpoint.position,
                   cycle=checkpoint.cycle, seconds=time.perf_counter() - started)


async def _call_model(agent: Agent, host: Host) -> AssistantMessage:
    ws = agent.ws
    assert ws is not None
    profile = agent.profile
    # MCP tools come and go with their servers' lists: asked for per call (cached there).
    specs = profile.specs if profile.mcp is None else await profile.mcp.current_specs()
    # Push off (the default): no coroutine per call.
    pushed = await pushed_for(agent, host) if agent.profile.config.push_recall else NOTHING
    rendered = ws.render(
        profile.config.system_prompt, profile.policy, specs, calibration=agent.calibration,
        recalled=pushed.block, pushed=pushed.kept,
    )
    agent.set_state(host, AgentState.STREAMING)
    hub = agent.hub
    parts: list[str] = []
    calls: list[ToolCall] = []
    usage: Usage | None = None
    started = time.perf_counter()
    first: float | None = None
    idle = agent.profile.config.model_idle_timeout
    clock = asyncio.get_running_loop().time  # the watchdog's clock
    conversation = CONVERSATION.set(agent.id)  # adapters key prompt caches by it
    tokens = CONTEXT_TOKENS.set(rendered.estimated_tokens)  # metrics need not recount
    observers = host.observers
    watching = observers.model_call(_call_info(agent, host, rendered.estimated_tokens,
                                               len(specs))) if observers else UNWATCHED
    with watching as watch:
        stream = _model_of(agent, host).stream(rendered.messages, specs)
        watched: Call | None = None
        try:
            # The call's own scope, which only the watchdog cancels, never the turn's: anyio
            # then tells its cancel apart from a caller's or the runtime's (those pass
            # through as cancels), and nothing of the turn outside this stream is hit.
            with scope() as call_scope:
                if idle is not None:
                    # Watched by the runtime's one watchdog task, not a timer per call: a
                    # chunk only stores the clock (see torpor.actors.watchdog).
                    watched = host.watchdog.watch(call_scope, idle)
                agent.cancellable = True
                if agent.cancels:  # a cancel came while the turn could not be interrupted
                    _cancel_turn(agent)
                async for item in stream:
                    if watched is not None:
                        watched.last = clock()
                    if isinstance(item, TextDelta):
                        if first is None:
                            first = time.perf_counter()
                            watch.first_token()
                        text = repair_text(item.text)
                        parts.append(text)
                        if hub is not None:
                            hub.text(text, agent.turn)
                    elif isinstance(item, ToolCallDelta):
                        calls.append(checked_call(item.call, calls))  # or the model's error
                    elif isinstance(item, Usage):
                        usage = item
                        watch.usage(item)
                agent.cancellable = False
            if call_scope.cancelled_caught:  # the watchdog ended the call: a model error
                raise _timeout(idle)
            turn_scope = agent.scope
            if turn_scope is not None and turn_scope.cancel_called:
                # Cancelled as the stream ended, before an await of it saw the cancel: it takes
                # effect here, as a cancel of this call (handled below), not after the answer.
                await anyio.lowlevel.checkpoint_if_cancelled()
        except anyio.get_cancelled_exc_class():
            agent.cancellable = False
            if watched is not None:  # not watched while it closes and records
                host.watchdog.release(watched)
            with scope(shield=True):  # the audit of a call is not lost to a cancel
                await _close(stream)
                await host.store.record_model_call(
                    _model_call(agent, host, rendered, started, first, None, error="cancelled",
                                pushed=pushed)
                )
            raise
        except Exception as exc:
            agent.cancellable = False
            if watched is not None:
                host.watchdog.release(watched)  # the call is over: not watched while it closes
            with scope(shield=True):
                await _close(stream)
                await host.store.record_model_call(
                    _model_call(agent, host, rendered, started, first, None, error=repr(exc),
                                pushed=pushed)
                )
            if isinstance(exc, StoreError):  # ours, not the model's
                raise
            watch.failed(exc)
            raise ModelFailed(exc, "".join(parts)) from exc
        finally:
            if watched is not None:
                host.watchdog.release(watched)
            CONVERSATION.reset(conversation)
            CONTEXT_TOKENS.reset(tokens)
        message = AssistantMessage("".join(parts), tuple(calls))
        watch.answered(message)
    audit = _model_call(agent, host, rendered, started, first, usage, pushed=pushed)
    # Not kept while the commit is awaited: with thousands of turns waiting on the writer,
    # every object a waiting turn holds is one more for the cyclic GC to walk.
    del rendered, stream, parts, calls, conversation, tokens, watched, pushed, clock
    # The answer and its audit row: one operation of one commit. No shield scope: nothing
    # can cancel it through a scope any more (the watchdog has let the call go, a caller's
    # cancel finds the turn not cancellable and is too late, and a cancel that came as the
    # stream ended was taken above); the runtime stops actors with Task.cancel, which no
    # scope holds back.
    await logged(agent, host, [message], turn=agent.turn, audit=audit, apply=True)
    return message


def _timeout(idle: float | None) -> ModelTimeout:
    return ModelTimeout(f"the model sent nothing for {idle:g} seconds")


def _call_info(agent: Agent, host: Host, estimated: int, tools: int) -> ModelCallInfo:
    model = _model_of(agent, host)
    provider, requested = getattr(model, "provider", None), getattr(model, "model", None)
    return ModelCallInfo(
        agent.id, agent.turn, agent.calls, _model_name(agent, host), estimated, tools,
        provider if isinstance(provider, str) else None,
        requested if isinstance(requested, str) else None,
    )


def _model_name(agent: Agent, host: Host) -> str:
    model = _model_of(agent, host)
    return getattr(model, "name", None) or type(model).__name__


def _model_of(agent: Agent, host: Host) -> Model:
    """The conversation's own model (``AgentConfig.model``), else the runtime's."""
    model: Model | None = agent.profile.config.model
    return model if model is not None else host.model


def _cancel_turn(agent: Agent) -> None:
    scope = agent.scope
    if scope is not None:
        scope.cancel()


async def _close(stream: object) -> None:
    """Close the model's stream (its HTTP response) at once, within a short deadline."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    # Closing a broken stream may fail again: it is closed either way.
    with anyio.move_on_after(5.0), contextlib.suppress(Exception):
        await aclose()


def _suspension(
    call_ids: tuple[str, ...], names: tuple[str, ...], approvals: tuple[str, ...] = ()
) -> Suspended:
    # The tool names feed the store's index of pending approvals.
    reason = "awaiting approval" if approvals and len(approvals) == len(call_ids) else (
        "awaiting outside answer"
    )
    return Suspended(call_ids, reason=reason, tools=names, approvals=approvals)


async def _record(host: Host, call: ModelCall) -> None:
    with anyio.CancelScope(shield=True):
        await host.store.record_model_call(call)


def _model_call(
    agent: Agent,
    host: Host,
    rendered: Rendered,
    started: float,
    first: float | None,
    usage: Usage | None,
    *,
    error: str | None = None,
    pushed: Pushed = NOTHING,
) -> ModelCall:
    """The audit row of one model call; also calibrates the agent's token estimate."""
    now = time.perf_counter()
    policy = agent.profile.policy
    if usage is not None:
        reported = _counted(usage.prompt_tokens)
        completion = _counted(usage.completion_tokens)
        cache_read = _counted(usage.cache_read_tokens)
        cache_write = _counted(usage.cache_write_tokens)
    else:
        reported = completion = cache_read = cache_write = None
    if reported and rendered.estimated_tokens:
        # Calibrate our tiktoken estimate against what the provider counted, and ask
        # for a fold before the next call when the real prompt nears the budget.
        agent.calibration = min(4.0, max(0.5, reported / rendered.estimated_tokens))
        if reported > policy.compaction_trigger_ratio * policy.input_budget:
            agent.compact_requested = True
    now_ms = int(time.time() * 1000)
    ws = agent.ws
    shape = anatomy(
        agent.id,
        agent.turn,
        ws.tail if ws is not None else (),
        ws.checkpoint if ws is not None else None,
        rendered.messages,
        now_ms,
    )
    changed = agent.topic is not None and shape.topic != agent.topic
    # Kept while the agent sleeps: interned, so agents on one topic share one string
    # instead of each pinning a copy made mid-turn among the turn's garbage.
    agent.topic = sys.intern(shape.topic) if shape.topic is not None else None
    return ModelCall(
        conversation_id=agent.id,
        turn=agent.turn,
        call_index=agent.calls,
        compaction_cycle=agent.cycle,
        recipe=encode_recipe(rendered.recipe),
        rendered_hash=rendered.hash,
        sections=rendered.sections,  # made for this render alone: no copy
        estimated_prompt_tokens=rendered.estimated_tokens,
        utilization=rendered.estimated_tokens / policy.input_budget,
        reported_prompt_tokens=reported,
        completion_tokens=completion,
        cache_read_tokens=cache_read,
        cache_write_tokens=cache_write,
        latency_ms=(now - started) * 1000.0,
        ttft_ms=(first - started) * 1000.0 if first is not None else None,
        created_at=now_ms,
        model=_model_name(agent, host),
        error=error,
        turn_id=shape.turn_id,
        events_in_context=shape.events_in_context,
        markers=shape.markers,
        topic=shape.topic,
        topic_changed=changed,
        pushed=tuple(position for position, _ in pushed.kept),
        pushed_scores=pushed.scores,
    )


def _counted(value: object) -> int | None:
    """A provider's token count as the audit can hold it; anything else (negative, not an
    int, past what the log holds) is unknown, never a reason for the turn to fail."""
    return value if type(value) is int and 0 <= value < 1 << 63 else None


async def _run_tools(
    agent: Agent, host: Host, calls: Sequence[ToolCall], approvals: list[str] | None = None
) -> tuple[str, ...]:
    """Run local and MCP calls concurrently, log their results in call order; return the
    ids waiting outside (external calls, and MCP calls waiting for an approval: those are
    added to ``approvals`` too)."""
    toolbox = agent.profile.toolbox
    config = agent.profile.config
    mcp = agent.profile.mcp
    timeout = config.tool_timeout
    grace = config.cancel_deadline
    results: dict[str, ToolResult] = {}
    external: list[str] = []

    observers = host.observers

    async def one(call: ToolCall) -> None:
        if observers:  # a tool's own spans nest under its call's
            info = ToolCallInfo(agent.id, agent.turn, call.id, call.name)
            with observers.tool_call(info):
                await run_one(call)
                observers.tool_result(info, results[call.id])
        else:
            await run_one(call)

    async def run_one(call: ToolCall) -> None:
        builtin = BUILTIN_TOOLS.get(call.name) if config.recall_tools else None
        if (call.name == TASK_CARD_TOOL.name and config.task_card_tool
                and toolbox.get(call.name) is None):
            results[call.id] = await _card_tool(agent, host, call)
            return
        if (call.name == SCHEDULE_TOOL.name and config.schedule_tool
                and toolbox.get(call.name) is None):
            results[call.id] = await run_schedule_tool(agent, host, call)
            return
        if builtin is not None and toolbox.get(call.name) is None:
            results[call.id] = await _run_builtin(agent, host, call)
            return
        tool = toolbox.get(call.name)
        if isinstance(tool, LocalTool):
            context = None if tool.context is None else await context_for(agent, host, call)
            results[call.id] = await run_tool(
                tool, call, timeout=timeout, grace=grace, abandon=host.abandon, context=context
            )
            return
        remote = mcp.get(call.name) if mcp is not None and tool is None else None
        if remote is not None:
            results[call.id] = await run_mcp(remote, call, timeout)
        else:
            results[call.id] = toolbox.unknown_tool_result(call)

    agent.cancellable = True
    try:
        if agent.cancels:
            _cancel_turn(agent)
        async with anyio.create_task_group() as tg:
            for call in calls:
                tool = toolbox.get(call.name)
                if isinstance(tool, ExternalTool):
                    try:
                        tool.validate(call.arguments)
                    except ToolArgumentError as exc:  # the model can fix it: no suspension
                        results[call.id] = ToolResult(call.id, call.name, str(exc), is_error=True)
                    else:
                        external.append(call.id)
                elif tool is None and mcp is not None and approvals is not None and (
                    (remote := mcp.get(call.name)) is not None and remote.gated
                ):
                    errors = remote.argument_errors(call.arguments)
                    if errors:  # the model can fix it: no approval asked for
                        results[call.id] = ToolResult(
                            call.id, call.name, str(ToolArgumentError(call.name,
                                                                      "; ".join(errors[:5]))),
                            is_error=True)
                    else:
                        external.append(call.id)
                        approvals.append(call.id)
                else:
                    tg.start_soon(one, call)
    finally:
        agent.cancellable = False
    done = [results[c.id] for c in calls if c.id in results]
    if done:
        await append(agent, host, done)
    return tuple(external)


async def _card_tool(agent: Agent, host: Host, call: ToolCall) -> ToolResult:
    """The model's ``task_card`` tool: the change is logged at once (in effect from the next
    model call), or the reason it was refused is the result."""
    try:
        change = card_change(agent, tool_patch(call.arguments), by="model")
        events = await logged(agent, host, change, turn=lambda: agent.turn)
    except InvalidInput as exc:
        return ToolResult(call.id, call.name, f"error: {exc}", is_error=True)
    return ToolResult(call.id, call.name, f"task card updated (event #{events[0].position})")


async def _run_builtin(agent: Agent, host: Host, call: ToolCall) -> ToolResult:
    args = call.arguments
    try:
        if call.name == RECALL_TOOL.name:
            query = args.get("query")
            k = args.get("k", 10)
            if not isinstance(query, str) or not query.strip():
                raise ValueError("recall needs a non-empty string 'query'")
            if not isinstance(k, int) or not 1 <= k <= 50:
                raise ValueError("'k' must be an integer from 1 to 50")
            echoes = args.get("include_recall_outputs", False)
            if not isinstance(echoes, bool):
                raise ValueError("'include_recall_outputs' must be true or false")
            hits = await recall_hits(
                host.store, agent.id, query, k, hybrid=host.hybrid, include_recall_outputs=echoes
            )
            content = format_hits(hits)
        else:
            start, end = args.get("start"), args.get("end", args.get("start"))
            if not isinstance(start, int) or not isinstance(end, int) or end < start:
                raise ValueError("expand needs integer 'start' <= 'end'")
            if end - start > 200:
                raise ValueError("expand returns at most 200 events at once")
            offset = args.get("offset", 0)
            limit = args.get("limit", EXPAND_PAGE_CHARS)
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise ValueError("'offset' must be an integer >= 0")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ValueError("'limit' must be a positive integer")
            limit = min(limit, EXPAND_PAGE_CHARS)
            events = await expand(host.store, agent.id, start, end)
            content = format_events(events, limit, offset)
        return ToolResult(call.id, call.name, repair_text(content))
    except (ValueError, msgspec.ValidationError) as exc:
        return ToolResult(call.id, call.name, f"error: {exc}", is_error=True)
