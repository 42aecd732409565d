"""Configuration is checked by type and range at construction, and every refusal names its field.

The property: whatever value one field is given (the others left at their
defaults), construction either succeeds with a value the field's rule accepts,
or raises ConfigError naming that field (or, for a value the rule accepts but
a relation between fields refuses, the field that relation names). Never a
bare TypeError, never a silently accepted 1.5 for an int.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor import (
    AgentConfig,
    ConfigError,
    Event,
    ExternalTool,
    LocalTool,
    RuntimeConfig,
    tool,
)
from torpor.compaction.policy import CompactionPolicy

CONFIGS: tuple[Any, ...] = (RuntimeConfig, AgentConfig, CompactionPolicy)


async def lookup(city: str) -> str:
    return city


def not_async(city: str) -> str:
    return city


class Summarizer:
    async def summarize(self, previous_summary: str, events: Sequence[Event]) -> str:
        return previous_summary


class SyncSummarizer:
    def summarize(self, previous_summary: str, events: Sequence[Event]) -> str:
        return previous_summary


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        (RuntimeConfig, "mailbox_bound", 1.5),
        (RuntimeConfig, "mailbox_bound", "3"),
        (RuntimeConfig, "max_concurrent_revivals", True),
        (RuntimeConfig, "evict_after", math.inf),
        (RuntimeConfig, "hibernate_after", math.nan),
        (RuntimeConfig, "backoff_initial", -0.1),
        (RuntimeConfig, "sweep_interval", 0),
        (RuntimeConfig, "durability", "sometimes"),
        (RuntimeConfig, "max_live_agents", 2**70),
        (AgentConfig, "max_steps", 2.5),
        (AgentConfig, "tools", [5]),
        (AgentConfig, "tools", [not_async]),
        (AgentConfig, "tools", "lookup"),
        (AgentConfig, "tools", [lookup, lookup]),  # two tools named 'lookup'
        (AgentConfig, "recall_tools", 1),
        (AgentConfig, "system_prompt", None),
        (AgentConfig, "system_prompt", "nul \x00 inside"),
        (AgentConfig, "summarizer", SyncSummarizer()),
        (AgentConfig, "summarizer", "summarize"),
        (AgentConfig, "tool_timeout", 0),
        (AgentConfig, "hard_ceiling_ratio", True),
        (AgentConfig, "context_window", 128_000.0),
        (CompactionPolicy, "encoding", ""),
        (CompactionPolicy, "keep_tool_results", -1),
        (CompactionPolicy, "clear_at_least", -1),
        (AgentConfig, "clear_at_least", 4_000.0),
    ],
)
def test_the_reported_values_are_refused_naming_the_field(
    config: Any, field: str, value: object
) -> None:
    with pytest.raises(ConfigError) as info:
        config(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: must be ")


def test_valid_values_of_every_kind_are_accepted() -> None:
    assert RuntimeConfig(hibernate_after=1, evict_after=1, backoff_initial=0,
                         sweep_interval=0.5, durability="full").evict_after == 1
    agent = AgentConfig(tools=[lookup, ExternalTool("ask")], summarizer=Summarizer(),
                        max_steps=1, hard_ceiling_ratio=1)
    assert isinstance(agent.tools, tuple)  # the caller's list cannot change it afterwards
    assert agent.policy().hard_ceiling == agent.context_window


def test_relations_name_a_field_they_read() -> None:
    with pytest.raises(ConfigError) as info:
        RuntimeConfig(hibernate_after=10, evict_after=5)
    assert info.value.field == "evict_after"
    with pytest.raises(ConfigError) as info:
        AgentConfig(context_window=4_000)
    assert info.value.field == "max_output_tokens"
    with pytest.raises(ConfigError) as info:
        AgentConfig(working_budget=100_000)
    assert info.value.field == "working_budget"


@pytest.mark.parametrize("config", CONFIGS)
def test_every_field_has_exactly_one_rule(config: Any) -> None:
    assert set(config.RULES) == set(config.__struct_fields__)
    for relation in config.RELATIONS:
        assert set(relation.fields) <= set(config.__struct_fields__)


def test_a_field_added_without_a_rule_fails_the_first_construction() -> None:
    class Extended(RuntimeConfig, frozen=True, kw_only=True):
        grace_period_for_test: float = 5.0

    with pytest.raises(TypeError, match="grace_period_for_test has no validation rule"):
        Extended()


# -- the property -------------------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-3, 300_000),
    st.integers(2**62, 2**80),
    st.floats(),
    st.floats(0, 2),
    st.floats(-1e12, 1e12),
    st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e9, 1e9 + 1]),
    st.text(max_size=8),
    st.sampled_from(["normal", "full", "cl100k_base", "\ud800", "\x00"]),
    st.binary(max_size=4),
    st.complex_numbers(max_magnitude=10),
    st.fractions(max_denominator=10),
    st.just(Fraction(1, 2)),
    st.lists(st.integers(), max_size=3),
    st.lists(
        st.sampled_from([lookup, not_async, ExternalTool("ask"), tool(lookup), 5, "x", None]),
        max_size=3,
    ),
    st.tuples(st.just(ExternalTool("ask"))),
    st.sampled_from([Summarizer(), SyncSummarizer(), object(), {"a": 1}, set()]),
)


def fits_annotation(kind: Any, value: object) -> bool:
    """An oracle independent of the rule tables: does ``value`` fit the field's annotation?

    ``int`` is a real int (not bool), ``float`` a finite real (not bool), a
    sequence of tools holds tools, ``Any`` (the summarizer) has an async ``summarize``.
    """
    if isinstance(kind, mi.UnionType):
        return any(fits_annotation(k, value) for k in kind.types)
    if isinstance(kind, mi.NoneType):
        return value is None
    if isinstance(kind, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(kind, mi.FloatType):
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value))
    if isinstance(kind, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(kind, mi.StrType):
        return isinstance(value, str)
    if isinstance(kind, mi.LiteralType):
        return isinstance(value, str) and value in kind.values
    if isinstance(kind, mi.ListType):  # AgentConfig.tools
        return isinstance(value, list | tuple) and all(
            isinstance(item, LocalTool | ExternalTool) or inspect.iscoroutinefunction(item)
            for item in value
        )
    if isinstance(kind, mi.AnyType):  # AgentConfig.summarizer
        return value is None or inspect.iscoroutinefunction(getattr(value, "summarize", None))
    raise AssertionError(f"no oracle for {kind}: extend fits_annotation")


ANNOTATIONS = {
    (config, f.name): f.type for config in CONFIGS for f in mi.type_info(config).fields
}


def _fields() -> st.SearchStrategy[tuple[Any, str]]:
    return st.sampled_from(
        [(config, name) for config in CONFIGS for name in config.__struct_fields__]
    )


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=_fields(), value=ANY_VALUE)
def test_any_value_is_accepted_validly_or_refused_naming_its_field(
    target: tuple[Any, str], value: object
) -> None:
    config, field = target
    rule = config.RULES[field]
    related = {field} | {r.fields[0] for r in config.RELATIONS if field in r.fields}
    try:
        built = config(**{field: value})
    except ConfigError as exc:
        if rule.accepts(value):
            assert exc.field in related, (exc.field, related)
        else:
            assert exc.field == field
        return
    assert rule.accepts(value), f"{config.__name__}.{field} accepted {value!r}"
    assert fits_annotation(ANNOTATIONS[config, field], value), (
        f"{config.__name__}.{field} accepted {value!r}, which does not fit its type"
    )
    assert msgspec.structs.astuple(built)  # and the struct is usable
