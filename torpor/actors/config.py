"""AgentConfig: what one conversation's agent is (prompt, tools, model budgets)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from torpor.compaction.policy import CompactionPolicy
from torpor.errors import ConfigError

__all__ = ["AgentConfig"]


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Per-conversation agent settings. Invalid values fail at construction, naming the field.

    Budgets (tokens): the input budget is ``context_window - max_output_tokens -
    safety_margin``; folding starts when the verbatim tail exceeds
    ``working_budget``; what is sent never exceeds ``hard_ceiling_ratio`` of the
    window. ``compaction_trigger_ratio``: a model-reported prompt size above this
    share of the input budget requests a fold before the next call.
    """

    system_prompt: str = "You are a helpful assistant."
    tools: Sequence[Any] = ()  # LocalTool (from torpor.tool) or ExternalTool
    tool_timeout: float = 30.0  # seconds per local tool call (a tool's own timeout wins)
    max_steps: int = 8  # model calls per turn before the turn is cut off
    recall_tools: bool = True  # offer the built-in recall/expand tools to the model
    context_window: int = 128_000
    max_output_tokens: int = 4_096
    safety_margin: int = 1_024
    working_budget: int = 32_000
    hard_ceiling_ratio: float = 0.75
    compaction_trigger_ratio: float = 0.8
    tail_turns: int = 4
    keep_tool_results: int = 3
    summarizer: Any = None  # optional torpor.compaction Summarizer
    # No chunk from the model for this many seconds ends the call (ModelTimeout); None: never.
    model_idle_timeout: float | None = 300.0
    # A cancelled or timed-out tool gets this long to stop; then it is abandoned (reported).
    cancel_deadline: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.system_prompt, str):
            raise ConfigError("system_prompt", "must be a string")
        if not self.tool_timeout > 0:
            raise ConfigError("tool_timeout", "must be > 0 seconds")
        if self.max_steps < 1:
            raise ConfigError("max_steps", "must be >= 1")
        if self.model_idle_timeout is not None and not self.model_idle_timeout > 0:
            raise ConfigError("model_idle_timeout", "must be > 0 seconds or None")
        if not self.cancel_deadline > 0:
            raise ConfigError("cancel_deadline", "must be > 0 seconds")
        self.policy()  # validates every budget field, naming it

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
        )
