"""The JSON Schema check of external tools' arguments (torpor.actors.json_schema): Draft
2020-12 as jsonschema implements it, messages that name the failing path, bad schemas
refused when the tool is defined, one compiled validator per schema object."""

from __future__ import annotations

from typing import Any

import pytest

import torpor.actors.json_schema as json_schema
from torpor.actors.json_schema import check_schema, schema_errors
from torpor.actors.tools import ExternalTool
from torpor.errors import ConfigError, ToolArgumentError


@pytest.mark.parametrize(
    "schema, value",
    [
        ({"enum": [1]}, True),  # True is not 1 in JSON
        ({"const": 0}, False),
        ({"type": "string", "pattern": "^[0-9]{3}$"}, "12a"),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "x"),
        ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, "x"),
        ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, [1, 2]),
        ({"type": "integer"}, True),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1.5}),
    ],
)
def test_what_the_hand_written_check_let_through_is_refused(schema: Any, value: Any) -> None:
    assert schema_errors(schema, value) != []


@pytest.mark.parametrize(
    "schema, value",
    [
        ({"enum": [1]}, 1),
        ({"const": 0}, 0),
        ({"type": "string", "pattern": "^[0-9]{3}$"}, "123"),
        ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
        ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, 4),
        ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, [1, "a"]),
        ({"type": "integer"}, 2.0),  # an integer-valued number is an integer in JSON Schema
        ({"type": "string", "format": "email"}, "not an address"),  # formats annotate only
    ],
)
def test_what_fits_passes(schema: Any, value: Any) -> None:
    assert schema_errors(schema, value) == []


def test_each_message_names_the_failing_path() -> None:
    schema = {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {"lines": {"type": "array", "items": {"type": "integer"}}},
            },
            "mode": {"enum": ["fast", "slow"]},
        },
        "required": ["mode"],
        "additionalProperties": False,
    }
    errors = schema_errors(schema, {"order": {"lines": [1, "two"]}, "mode": "x", "extra": 0})
    assert sorted(errors) == sorted([
        "arguments.order.lines[1]: 'two' is not of type 'integer'",
        "arguments.mode: 'x' is not one of ['fast', 'slow']",
        "arguments: Additional properties are not allowed ('extra' was unexpected)",
    ])
    assert schema_errors(schema, {}, "args") == ["args: 'mode' is a required property"]


def test_a_huge_argument_is_not_echoed_whole() -> None:
    (message,) = schema_errors({"type": "string", "maxLength": 3}, "x" * 100_000)
    assert message.startswith("arguments: 'xxx") and len(message) < 300


def test_external_tool_validate_raises_the_typed_error_naming_tool_and_paths() -> None:
    ship = ExternalTool("ship", parameters={
        "type": "object", "properties": {"qty": {"type": "integer", "minimum": 1}},
        "required": ["qty"],
    })
    ship.validate({"qty": 3})
    with pytest.raises(ToolArgumentError) as info:
        ship.validate({"qty": 0})
    assert info.value.tool == "ship"
    assert str(info.value) == "invalid arguments for tool 'ship': arguments.qty: 0 is less " \
        "than the minimum of 1"


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({"type": "strin"}, "not a valid JSON schema: 'strin' is not valid under any"),
        ({"properties": {"a": {"pattern": "("}}}, "(at properties.a.pattern)"),
        ({"required": "a"}, "(at required)"),
        ({"properties": {"a": {"minimum": "1"}}}, "(at properties.a.minimum)"),
        ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "$ref '#/$defs/missing' does not"),
        ({"$ref": "https://example.com/order.json"}, "nothing is fetched"),
        ({"$schema": "urn:no-such-draft"}, "unknown $schema 'urn:no-such-draft'"),
    ],
)
def test_a_bad_schema_fails_when_the_tool_is_defined(parameters: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        ExternalTool("approve", parameters=parameters)
    assert info.value.field == "tools"
    assert str(info.value).startswith("tools: tool 'approve': parameters: ")
    assert fragment in str(info.value)


def test_references_resolve_against_their_own_base_and_other_drafts_are_honoured() -> None:
    nested = {
        "$defs": {
            "money": {
                "$id": "https://torpor.invalid/money",
                "$defs": {"amount": {"type": "integer"}},
                "properties": {"cents": {"$ref": "#/$defs/amount"}},
            },
        },
        "properties": {"price": {"$ref": "https://torpor.invalid/money"}},
    }
    ExternalTool("price", parameters=nested)  # resolves within the schema: accepted
    assert schema_errors(nested, {"price": {"cents": "x"}}) == [
        "arguments.price.cents: 'x' is not of type 'integer'"
    ]
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "string"}]}
    assert schema_errors(draft7, [1]) == ["arguments[0]: 1 is not of type 'string'"]


def test_one_compiled_validator_per_schema_object(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[object] = []
    real = json_schema._compile

    def counting(schema: Any, what: str) -> Any:
        compiled.append(schema)
        return real(schema, what)

    monkeypatch.setattr(json_schema, "_compile", counting)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tool = ExternalTool("count", parameters=schema)
    assert compiled == [schema]  # checked and compiled at definition
    for n in range(3):
        tool.validate({"n": n})
    assert schema_errors(schema, {"n": "x"}) != []
    assert len(compiled) == 1  # not again per call
    check_schema(dict(schema))  # an equal but other object: its own
    assert len(compiled) == 2
