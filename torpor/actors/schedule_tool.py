"""The model's ``schedule`` tool (``AgentConfig(schedule_tool=True)``): the model sets and
cancels its own follow-ups ("check the deploy in 10 minutes"), as ``Runtime.schedule``
and ``Runtime.unschedule`` would, within ``AgentConfig.max_schedules`` pending schedules
per conversation (past it: an error result, nothing scheduled). The result says what was
done, or why not; the model can fix its arguments and call again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torpor.errors import InvalidInput, UnknownConversation
from torpor.events import ToolCall, ToolResult
from torpor.llm.protocol import ToolSpec
from torpor.store.schedules import MIN_EVERY, check_new

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host

__all__ = ["SCHEDULE_TOOL", "run_schedule_tool"]

SCHEDULE_TOOL = ToolSpec(
    name="schedule",
    description=(
        "Wake yourself later in this conversation: action 'add' logs 'text' as a scheduled "
        "message to you after 'after_seconds' (repeating every 'every_seconds' if given); "
        "'cancel' cancels 'schedule_id'; 'list' lists what is scheduled."
    ),
    parameters={
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["add", "cancel", "list"]},
            "text": {"type": "string"},
            "after_seconds": {"type": "number", "minimum": 0},
            "every_seconds": {"type": "number", "minimum": MIN_EVERY},
            "schedule_id": {"type": "string"},
        },
        "required": ["action"],
    },
)


def _error(call: ToolCall, message: str) -> ToolResult:
    return ToolResult(call.id, call.name, f"error: {message}", is_error=True)


async def run_schedule_tool(agent: Agent, host: Host, call: ToolCall) -> ToolResult:
    args = call.arguments
    action = args.get("action")
    store = host.store
    try:
        if action == "add":
            every = args.get("every_seconds")
            after = args.get("after_seconds", None if every is not None else 0)
            new = check_new(agent.id, args.get("text"), at=None, after=after, every=every,
                            key=None, now=host.schedule_now())
            limit = agent.profile.config.max_schedules
            schedule = await store.add_schedule(new, at_most=limit)
            if host.poke_schedules is not None and schedule.due is not None:
                host.poke_schedules(schedule.due)
            repeat = "" if schedule.every is None else f", every {schedule.every:g} s"
            return ToolResult(call.id, call.name,
                              f"scheduled {schedule.id} in {new.due - new.created_at} ms{repeat}")
        if action == "cancel":
            sid = args.get("schedule_id")
            if not isinstance(sid, str) or not sid:
                raise InvalidInput("schedule_id", "is needed to cancel")
            done = await store.remove_schedule(agent.id, sid)
            return ToolResult(call.id, call.name,
                              f"cancelled {sid}" if done else f"no pending schedule {sid}")
        if action == "list":
            found = await store.conversation_schedules(agent.id)
            lines = [f"{s.id}: due {s.due} ms" + ("" if s.every is None else f", every "
                     f"{s.every:g} s") + f": {s.text[:80]}" for s in found]
            return ToolResult(call.id, call.name, "\n".join(lines) or "nothing scheduled")
        raise InvalidInput("action", "must be 'add', 'cancel' or 'list'")
    except (InvalidInput, UnknownConversation) as exc:  # TooManySchedules is an InvalidInput
        return _error(call, str(exc))
