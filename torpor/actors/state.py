"""The actor's states as data, and the transitions between them.

Like gen_statem: a state is a value, a transition is explicit, and an
undeclared transition is a bug that crashes the agent (the supervisor then
restarts it from the log).
"""

from __future__ import annotations

import enum

from torpor.errors import InvalidTransition

__all__ = ["TRANSITIONS", "AgentState", "InvalidTransition"]


class AgentState(enum.Enum):
    REVIVING = "reviving"  # reading its working set back from the log
    AWAITING_INPUT = "awaiting_input"  # idle; may be hibernated
    STREAMING = "streaming"  # a model call is in flight
    RUNNING_TOOLS = "running_tools"  # local tool calls of this turn are running
    SUSPENDED = "suspended"  # waiting for outside answers to tool calls; may be hibernated
    PARKED = "parked"  # crashed too often; refuses input until unparked
    STOPPED = "stopped"  # its task has ended (runtime shutdown)
    EVICTED = "evicted"  # not in memory at all (reported by admin, never held by an agent)

    def __str__(self) -> str:
        return self.value


S = AgentState
TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    S.REVIVING: frozenset({S.AWAITING_INPUT, S.SUSPENDED, S.PARKED, S.STOPPED}),
    S.AWAITING_INPUT: frozenset({S.STREAMING, S.REVIVING, S.PARKED, S.STOPPED}),
    S.STREAMING: frozenset({S.RUNNING_TOOLS, S.SUSPENDED, S.AWAITING_INPUT, S.STREAMING,
                            S.REVIVING, S.PARKED, S.STOPPED}),
    S.RUNNING_TOOLS: frozenset({S.STREAMING, S.SUSPENDED, S.AWAITING_INPUT, S.REVIVING,
                                S.PARKED, S.STOPPED}),
    S.SUSPENDED: frozenset({S.STREAMING, S.AWAITING_INPUT, S.REVIVING, S.PARKED, S.STOPPED}),
    S.PARKED: frozenset({S.REVIVING, S.STOPPED}),
    S.STOPPED: frozenset({S.REVIVING}),
    S.EVICTED: frozenset({S.REVIVING}),
}

