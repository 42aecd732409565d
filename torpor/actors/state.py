"""The actor's states as data, and the transitions between them.

Like gen_statem: a state is a value, a transition is explicit, and an
undeclared transition is a bug that crashes the agent (the supervisor then
restarts it from the log). Every change of an agent's state, and every state
the runtime reports about an agent (``admin.watch()``, the admission queue),
is a state of this table and a transition it declares: :func:`transition` is
the one check.

Three states are never held in an agent's record, only reported: an agent
that dropped its caches is ``hibernated`` (its record keeps ``awaiting_input``
or ``suspended``, which revival restores), one not in memory is ``evicted``,
and one waiting for a slot under the live-agent cap is ``queued``.
"""

from __future__ import annotations

import enum

from torpor.errors import InvalidTransition

__all__ = ["REPORTED", "TRANSITIONS", "AgentState", "InvalidTransition", "transition"]


class AgentState(enum.Enum):
    REVIVING = "reviving"  # reading its working set back from the log
    AWAITING_INPUT = "awaiting_input"  # idle; may be hibernated
    STREAMING = "streaming"  # a model call is in flight
    RUNNING_TOOLS = "running_tools"  # local tool calls of this turn are running
    SUSPENDED = "suspended"  # waiting for outside answers to tool calls; may be hibernated
    PARKED = "parked"  # crashed too often; refuses input until unparked
    STOPPED = "stopped"  # its task has ended (runtime shutdown)
    HIBERNATED = "hibernated"  # reported: caches dropped (the record keeps its idle state)
    QUEUED = "queued"  # reported: logged input waits for a slot under max_live_agents
    EVICTED = "evicted"  # reported: not in memory at all (the log keeps everything)

    def __str__(self) -> str:
        return self.value


S = AgentState
REPORTED = frozenset({S.HIBERNATED, S.QUEUED, S.EVICTED})
"""States reported about an agent and never held by its record."""

_LEAVE = (S.REVIVING, S.PARKED, S.STOPPED, S.EVICTED)  # a crash, parking, shutdown, a shard move
TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    S.REVIVING: frozenset({S.AWAITING_INPUT, S.SUSPENDED, S.PARKED, S.STOPPED, S.EVICTED}),
    S.AWAITING_INPUT: frozenset({S.STREAMING, S.HIBERNATED, *_LEAVE}),
    S.STREAMING: frozenset({S.RUNNING_TOOLS, S.SUSPENDED, S.AWAITING_INPUT, S.STREAMING,
                            *_LEAVE}),
    S.RUNNING_TOOLS: frozenset({S.STREAMING, S.SUSPENDED, S.AWAITING_INPUT, *_LEAVE}),
    # RUNNING_TOOLS: a continuation first runs the calls approved (torpor.mcp).
    S.SUSPENDED: frozenset({S.STREAMING, S.RUNNING_TOOLS, S.AWAITING_INPUT, S.HIBERNATED,
                            *_LEAVE}),
    S.PARKED: frozenset({S.REVIVING, S.STOPPED, S.EVICTED}),
    S.STOPPED: frozenset({S.REVIVING, S.EVICTED}),
    S.HIBERNATED: frozenset({S.REVIVING, S.EVICTED, S.PARKED, S.STOPPED}),
    S.QUEUED: frozenset({S.REVIVING, S.EVICTED, S.STOPPED}),
    S.EVICTED: frozenset({S.REVIVING, S.QUEUED}),
}


def transition(conversation_id: str, old: AgentState, new: AgentState) -> AgentState:
    """``new`` if the table declares ``old -> new``; InvalidTransition otherwise."""
    if new not in TRANSITIONS[old]:
        raise InvalidTransition(f"{conversation_id}: {old} -> {new}")
    return new
