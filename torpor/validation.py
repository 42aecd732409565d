"""Table-driven checks for configuration structs: every field by type and range.

msgspec checks types only when it decodes, not when a struct is constructed,
so ``RuntimeConfig(mailbox_bound=1.5)`` would be accepted as is. Each config
struct therefore declares one :class:`Rule` per field (a missing rule is a bug
that fails the first construction) plus the :class:`Relation`\\ s between
fields, and calls :func:`check_fields` from ``__post_init__``. Adding a field is
adding one line to its table.

Every refusal is a :class:`~torpor.errors.ConfigError` naming the field: a
rule names its own field; a relation names the first of the fields it reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torpor.errors import ConfigError
from torpor.text import is_storable

__all__ = [
    "MAX_INT",
    "MAX_SECONDS",
    "Relation",
    "Rule",
    "check_fields",
    "choice",
    "custom",
    "flag",
    "integer",
    "number",
    "optional",
    "seconds",
    "text",
]

MAX_INT = 2**63 - 1
"""Largest integer setting: counts and sizes may reach SQL parameters and C APIs."""

MAX_SECONDS = 1e9
"""Longest duration (about 31 years, i.e. never): ``now + value`` must still be exact."""


@dataclass(frozen=True, slots=True)
class Rule:
    """What one field accepts: ``problem(value)`` is None when valid, else why not."""

    describe: str  # "an integer >= 1", for messages and docs
    problem: Callable[[object], str | None]

    def check(self, field: str, value: object) -> None:
        reason = self.problem(value)
        if reason is not None:
            raise ConfigError(field, f"must be {self.describe}, got {_show(value)}{reason}")

    def accepts(self, value: object) -> bool:
        return self.problem(value) is None


@dataclass(frozen=True, slots=True)
class Relation:
    """A constraint between fields; ``problem(obj)`` is None when it holds, else why not.

    ``fields`` lists every field it reads; the error names the first.
    """

    fields: tuple[str, ...]
    problem: Callable[[Any], str | None]


def _show(value: object) -> str:
    try:
        shown = repr(value)
    except Exception:  # a hostile __repr__ must not replace the ConfigError
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= 60 else shown[:57] + "..."


def integer(minimum: int = 0, maximum: int = MAX_INT) -> Rule:
    """A real int (not bool, not float) in ``[minimum, maximum]``."""

    def problem(value: object) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):  # True is an int to Python
            return f" ({type(value).__name__})"
        return None if minimum <= value <= maximum else ""

    limit = f" and <= {maximum:_}" if maximum != MAX_INT else ""
    return Rule(f"an integer >= {minimum}{limit}", problem)


def number(
    minimum: float, maximum: float, *, open_min: bool = False, open_max: bool = False
) -> Rule:
    """A finite int or float (not bool) within the bounds (``open_*``: bound excluded)."""

    def problem(value: object) -> str | None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f" ({type(value).__name__})"
        try:
            as_float = float(value)
        except OverflowError:  # an int too large for a float
            return ""
        if not math.isfinite(as_float):
            return ""
        low_ok = as_float > minimum if open_min else as_float >= minimum
        high_ok = as_float < maximum if open_max else as_float <= maximum
        return None if low_ok and high_ok else ""

    low = f"{'(' if open_min else '['}{minimum:g}"
    high = f"{maximum:g}{')' if open_max else ']'}"
    return Rule(f"a finite number in {low}, {high}", problem)


def seconds(*, zero: bool = False) -> Rule:
    """A duration in seconds: finite, > 0 (or >= 0 with ``zero``), at most MAX_SECONDS."""
    rule = number(0.0, MAX_SECONDS, open_min=not zero)
    sign = ">=" if zero else ">"
    return Rule(f"a number of seconds {sign} 0 and <= {MAX_SECONDS:g}", rule.problem)


def text(*, empty: bool = True) -> Rule:
    """A str every backend can hold (no NUL, no lone surrogate); non-empty unless ``empty``."""

    def problem(value: object) -> str | None:
        if not isinstance(value, str):
            return f" ({type(value).__name__})"
        if not empty and not value:
            return ""
        return None if is_storable(value) else " (contains NUL or a lone surrogate)"

    return Rule("a string" if empty else "a non-empty string", problem)


def flag() -> Rule:
    """True or False (not 0 or 1: a typo'd number is not a decision)."""
    return Rule("True or False", lambda value: None if isinstance(value, bool) else "")


def choice(*values: str) -> Rule:
    """One of the given strings."""
    shown = ", ".join(repr(v) for v in values)
    return Rule(
        f"one of {shown}",
        lambda value: None if isinstance(value, str) and value in values else "",
    )


def optional(rule: Rule) -> Rule:
    """None, or what ``rule`` accepts."""
    return Rule(
        f"None or {rule.describe}",
        lambda value: None if value is None else rule.problem(value),
    )


def custom(describe: str, problem: Callable[[object], str | None]) -> Rule:
    """A rule with its own check (``problem`` returns the reason, with a leading space)."""
    return Rule(describe, problem)


def check_fields(
    obj: Any, rules: Mapping[str, Rule], relations: Sequence[Relation] = ()
) -> None:
    """Check every field of the msgspec struct ``obj`` by its rule, then the relations."""
    for name in obj.__struct_fields__:
        rule = rules.get(name)
        if rule is None:  # a field added without a rule: a bug, caught by any construction
            raise TypeError(f"{type(obj).__name__}.{name} has no validation rule")
        rule.check(name, getattr(obj, name))
    for relation in relations:
        reason = relation.problem(obj)
        if reason is not None:
            raise ConfigError(relation.fields[0], reason)
