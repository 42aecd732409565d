"""The token budgets one agent's context is assembled under.

Three numbers matter: the *input budget* (what the model can take after its
answer and a safety margin), the *working budget* (when the verbatim tail is
folded into a checkpoint: a cost knob, well below the window) and the *hard
ceiling* (never exceeded by what is sent, whatever the conversation holds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from torpor.compaction.tokens import DEFAULT_ENCODING
from torpor.validation import Relation, Rule, check_fields, integer, number, text

__all__ = ["BUDGET_RELATIONS", "CompactionPolicy"]


# The budgets read off any object with the budget fields (AgentConfig has them too).
def _input_budget(c: Any) -> int:
    return int(c.context_window - c.max_output_tokens - c.safety_margin)


def _no_input_budget(c: Any) -> str | None:
    if _input_budget(c) > 0:
        return None
    return (
        f"max_output_tokens + safety_margin ({c.max_output_tokens} + {c.safety_margin}) "
        f"leave no input budget in a {c.context_window}-token window"
    )


def _no_ceiling(c: Any) -> str | None:
    if int(c.context_window * c.hard_ceiling_ratio) > 0:
        return None
    return f"leaves a hard ceiling of 0 tokens in a {c.context_window}-token window"


def _budget_over_ceiling(c: Any) -> str | None:
    ceiling = min(int(c.context_window * c.hard_ceiling_ratio), _input_budget(c))
    if c.working_budget <= ceiling:
        return None
    return (
        f"{c.working_budget} exceeds the hard ceiling of {ceiling} tokens (min of "
        "hard_ceiling_ratio * context_window and the input budget)"
    )


BUDGET_RELATIONS: tuple[Relation, ...] = (
    Relation(("max_output_tokens", "safety_margin", "context_window"), _no_input_budget),
    Relation(("hard_ceiling_ratio", "context_window"), _no_ceiling),
    Relation(
        ("working_budget", "context_window", "hard_ceiling_ratio", "max_output_tokens",
         "safety_margin"),
        _budget_over_ceiling,
    ),
)
"""Constraints between the budget fields, checked after each field's own rule."""


class CompactionPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Budgets in tokens. Invalid values raise ConfigError naming the field at construction."""

    context_window: int = 128_000
    max_output_tokens: int = 4_096
    safety_margin: int = 1_024
    working_budget: int = 32_000
    hard_ceiling_ratio: float = 0.75
    compaction_trigger_ratio: float = 0.8
    tail_turns: int = 4  # turns kept verbatim by a fold (fewer if they alone are over budget)
    keep_tool_results: int = 3  # most recent tool results rendered whole; older ones stubbed
    # ... in batches: older results are stubbed only once that frees this many tokens (0:
    # each as soon as it is older), so the prompt prefix a provider caches changes rarely.
    clear_at_least: int = 4_000
    stub_tokens: int = 10  # informational: about what one stubbed result costs
    clip_tokens: int = 4_000  # a rendered message above this is clipped with a pointer
    max_markers: int = 8  # pointer markers kept in a checkpoint (merged beyond that)
    max_topics: int = 8  # topic hints per marker
    encoding: str = DEFAULT_ENCODING

    # One rule per field (check_fields refuses a field without one); then the relations.
    RULES: ClassVar[Mapping[str, Rule]] = {
        "context_window": integer(1),
        "max_output_tokens": integer(1),
        "safety_margin": integer(0),
        "working_budget": integer(1),
        "hard_ceiling_ratio": number(0.0, 1.0, open_min=True),
        "compaction_trigger_ratio": number(0.0, 1.0, open_min=True),
        "tail_turns": integer(1),
        "keep_tool_results": integer(0),
        "clear_at_least": integer(0),
        "stub_tokens": integer(1),
        "clip_tokens": integer(1),
        "max_markers": integer(1),
        "max_topics": integer(1),
        "encoding": text(empty=False),
    }
    RELATIONS: ClassVar[tuple[Relation, ...]] = BUDGET_RELATIONS

    def __post_init__(self) -> None:
        self.validate()

    @property
    def input_budget(self) -> int:
        """What the model may be given: window minus its answer minus a safety margin."""
        return self.context_window - self.max_output_tokens - self.safety_margin

    @property
    def hard_ceiling(self) -> int:
        return int(self.context_window * self.hard_ceiling_ratio)

    @property
    def effective_ceiling(self) -> int:
        """The never-exceed size of a rendered context: the stricter of ceiling and budget."""
        return min(self.hard_ceiling, self.input_budget)

    @property
    def trigger_tokens(self) -> int:
        """A model-reported prompt size above this requests a fold before the next call."""
        return int(self.compaction_trigger_ratio * self.input_budget)

    @property
    def clip_limit(self) -> int:
        """Largest single message rendered whole (clip_tokens, at most half the ceiling)."""
        return max(1, min(self.clip_tokens, self.effective_ceiling // 2))

    def validate(self) -> None:
        """Raise ConfigError(field, why) for the first invalid value."""
        check_fields(self, self.RULES, self.RELATIONS)
