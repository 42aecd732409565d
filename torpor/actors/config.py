"""AgentConfig: what one conversation's agent is (prompt, tools, model budgets)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import msgspec

from torpor.actors.tools import Toolbox
from torpor.compaction.policy import BUDGET_RELATIONS, CompactionPolicy
from torpor.errors import ConfigError
from torpor.mcp.servers import MCPServerHTTP, MCPServerStdio
from torpor.validation import (
    Relation,
    Rule,
    check_fields,
    custom,
    flag,
    integer,
    number,
    optional,
    seconds,
    text,
)

__all__ = ["AgentConfig"]


def _tools_problem(value: object) -> str | None:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return f" ({type(value).__name__}, not a list or tuple of tools)"
    try:
        Toolbox(value)  # what the runtime builds from it later: refuse now what it would refuse
    except ConfigError as exc:
        return f" ({str(exc).removeprefix('tools: ')})"
    except Exception as exc:  # a function whose signature has no JSON schema, say
        return f" ({type(exc).__name__}: {exc})"
    return None


def _servers_problem(value: object) -> str | None:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        return f" ({type(value).__name__}, not a list of MCP servers)"
    names: set[str] = set()
    for server in value:
        if not isinstance(server, MCPServerStdio | MCPServerHTTP):
            return f" ({type(server).__name__}, not MCPServerStdio or MCPServerHTTP)"
        if server.name in names:  # the prefix that tells clashing tools apart
            return f" (two servers are named {server.name!r}: give one another name=)"
        names.add(server.name)
    return None


def _method_problem(value: object, method: str, *, coroutine: bool) -> str | None:
    """None when ``value`` is None or has ``method`` (a coroutine function or not, as asked)."""
    try:
        found = getattr(value, method, None)
    except Exception:  # a hostile __getattr__ is a bad value, not a crash
        found = None
    if value is None or (callable(found) and inspect.iscoroutinefunction(found) == coroutine):
        return None
    kind = "an async" if coroutine else "a synchronous"
    return f" ({type(value).__name__}, without {kind} {method} method)"


def _summarizer_problem(value: object) -> str | None:
    return _method_problem(value, "summarize", coroutine=True)


def _reconciler_problem(value: object) -> str | None:
    return _method_problem(value, "decide", coroutine=False)


def _consolidator_problem(value: object) -> str | None:
    return _method_problem(value, "sweep", coroutine=True)


def _model_problem(value: object) -> str | None:
    try:
        stream = getattr(value, "stream", None)
    except Exception:  # a hostile __getattr__ is a bad model, not a crash
        stream = None
    if value is None or callable(stream):
        return None
    return f" ({type(value).__name__}, without a stream method)"


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Per-conversation agent settings. Invalid values fail at construction, naming the field.

    Budgets (tokens): the input budget is ``context_window - max_output_tokens -
    safety_margin``; folding starts when the verbatim tail exceeds
    ``working_budget``; what is sent never exceeds ``hard_ceiling_ratio`` of the
    window. ``compaction_trigger_ratio``: a model-reported prompt size above this
    share of the input budget requests a fold before the next call. Tool results
    older than the newest ``keep_tool_results`` are stubbed in batches that free at
    least ``clear_at_least`` tokens (0: each at once), so the prompt prefix a
    provider caches changes only at those batches and at folds.
    """

    system_prompt: str = "You are a helpful assistant."
    # This conversation's model (a torpor Model); None: the runtime's ``model=``.
    model: Any = None
    tools: Sequence[Any] = ()  # LocalTool (from torpor.tool), ExternalTool or an async function
    tool_timeout: float = 30.0  # seconds per local tool call (a tool's own timeout wins)
    # MCP servers whose tools join ``tools`` (torpor.mcp.MCPServerStdio / MCPServerHTTP;
    # one session per server per runtime, shared by every agent naming it).
    mcp_servers: Sequence[Any] = ()
    max_steps: int = 8  # model calls per turn (across its suspensions) before it is cut off
    recall_tools: bool = True  # offer the built-in recall/expand tools to the model
    context_window: int = 128_000
    max_output_tokens: int = 4_096
    safety_margin: int = 1_024
    working_budget: int = 32_000
    hard_ceiling_ratio: float = 0.75
    compaction_trigger_ratio: float = 0.8
    tail_turns: int = 4
    keep_tool_results: int = 3
    clear_at_least: int = 4_000  # tokens a batch of tool-result stubs must free (0: no batching)
    summarizer: Any = None  # optional torpor.compaction Summarizer
    # Optional torpor.memory Reconciler (ADD/NONE per finished turn; None: every turn ADD)
    # and Consolidator (the sweep's UPDATE/DELETE; None: torpor.memory.KeyedConsolidator).
    reconciler: Any = None
    consolidator: Any = None
    # No chunk from the model for this many seconds ends the call (ModelTimeout); None: never.
    model_idle_timeout: float | None = 300.0
    # A cancelled or timed-out tool gets this long to stop; then it is abandoned (reported).
    cancel_deadline: float = 5.0
    # The task card (torpor.compaction.task_card): its own token budget (a change over it
    # is refused with TaskCardTooLarge), and whether the model gets the task_card tool.
    task_card_tokens: int = 512
    task_card_tool: bool = False
    # The model's schedule tool (torpor.actors.schedule_tool): off by default; the pending
    # schedules a conversation may have through it.
    schedule_tool: bool = False
    max_schedules: int = 10
    # Task-conditioned push (torpor.compaction.push): off until measured to help; the
    # recalled section's budget (tokens) and MMR's lambda.
    push_recall: bool = False
    push_tokens: int = 2_000
    push_lambda: float = 0.7

    # One rule per field (check_fields refuses a field without one); then the relations.
    RULES: ClassVar[Mapping[str, Rule]] = {
        "system_prompt": text(),
        "model": custom("None or a torpor Model (an object with a stream method)",
                        _model_problem),
        "tools": custom("a list of LocalTool, ExternalTool or async functions", _tools_problem),
        "tool_timeout": seconds(),
        "mcp_servers": custom("a list of MCPServerStdio or MCPServerHTTP with distinct names",
                              _servers_problem),
        "max_steps": integer(1),
        "recall_tools": flag(),
        **{name: CompactionPolicy.RULES[name] for name in (
            "context_window", "max_output_tokens", "safety_margin", "working_budget",
            "hard_ceiling_ratio", "compaction_trigger_ratio", "tail_turns", "keep_tool_results",
            "clear_at_least",
        )},
        "summarizer": custom("None or an object with an async summarize method",
                             _summarizer_problem),
        "reconciler": custom("None or an object with a decide method", _reconciler_problem),
        "consolidator": custom("None or an object with an async sweep method",
                               _consolidator_problem),
        "model_idle_timeout": optional(seconds()),
        "cancel_deadline": seconds(),
        "task_card_tokens": integer(16, 100_000),
        "task_card_tool": flag(),
        "schedule_tool": flag(),
        "max_schedules": integer(1, 100_000),
        "push_recall": flag(),
        "push_tokens": integer(64, 1_000_000),
        "push_lambda": number(0.0, 1.0),
    }
    RELATIONS: ClassVar[tuple[Relation, ...]] = BUDGET_RELATIONS

    def __post_init__(self) -> None:
        check_fields(self, self.RULES, self.RELATIONS)
        if isinstance(self.tools, list):  # a tuple: the caller's list can't change it later
            msgspec.structs.force_setattr(self, "tools", tuple(self.tools))
        if isinstance(self.mcp_servers, list):
            msgspec.structs.force_setattr(self, "mcp_servers", tuple(self.mcp_servers))

    def policy(self) -> CompactionPolicy:
        return CompactionPolicy(
            context_window=self.context_window,
            max_output_tokens=self.max_output_tokens,
            safety_margin=self.safety_margin,
            working_budget=self.working_budget,
            hard_ceiling_ratio=self.hard_ceiling_ratio,
            compaction_trigger_ratio=self.compaction_trigger_ratio,
            tail_turns=self.tail_turns,
            keep_tool_results=self.keep_tool_results,
            clear_at_least=self.clear_at_least,
        )
