"""The token budgets one agent's context is assembled under.

Three numbers matter: the *input budget* (what the model can take after its
answer and a safety margin), the *working budget* (when the verbatim tail is
folded into a checkpoint: a cost knob, well below the window) and the *hard
ceiling* (never exceeded by what is sent, whatever the conversation holds).
"""

from __future__ import annotations

import msgspec

from torpor.compaction.tokens import DEFAULT_ENCODING
from torpor.errors import ConfigError

__all__ = ["CompactionPolicy"]


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
    stub_tokens: int = 10  # informational: about what one stubbed result costs
    clip_tokens: int = 4_000  # a rendered message above this is clipped with a pointer
    max_markers: int = 8  # pointer markers kept in a checkpoint (merged beyond that)
    max_topics: int = 8  # topic hints per marker
    encoding: str = DEFAULT_ENCODING

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
        for name in (
            "context_window",
            "max_output_tokens",
            "working_budget",
            "tail_turns",
            "stub_tokens",
            "clip_tokens",
            "max_markers",
            "max_topics",
        ):
            _positive_int(name, getattr(self, name))
        for name in ("safety_margin", "keep_tool_results"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ConfigError(name, f"must be an integer >= 0, got {value!r}")
        for name in ("hard_ceiling_ratio", "compaction_trigger_ratio"):
            ratio = getattr(self, name)
            if not isinstance(ratio, int | float) or isinstance(ratio, bool):
                raise ConfigError(name, f"must be a number, got {ratio!r}")
            if not 0.0 < ratio <= 1.0:
                raise ConfigError(name, f"must be in (0, 1], got {ratio!r}")
        if self.input_budget <= 0:
            raise ConfigError(
                "max_output_tokens",
                f"max_output_tokens + safety_margin ({self.max_output_tokens} + "
                f"{self.safety_margin}) leave no input budget in a "
                f"{self.context_window}-token window",
            )
        if self.hard_ceiling <= 0:
            raise ConfigError("hard_ceiling_ratio", "leaves a hard ceiling of 0 tokens")
        if self.working_budget > self.effective_ceiling:
            raise ConfigError(
                "working_budget",
                f"{self.working_budget} exceeds the hard ceiling of {self.effective_ceiling} "
                "tokens (min of hard_ceiling_ratio * context_window and the input budget)",
            )
        if not isinstance(self.encoding, str) or not self.encoding:
            raise ConfigError("encoding", "must name a tiktoken encoding")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(name, f"must be an integer > 0, got {value!r}")
