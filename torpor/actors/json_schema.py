"""A small JSON Schema check for the arguments of externally answered tool calls.

Local tools validate through their msgspec Struct. An ``ExternalTool`` is
described by a hand-written JSON schema instead, and a call whose arguments
break it should be answered with an error result at once (the model can fix
it) rather than suspend a turn on a call nobody can act on. This covers the
keywords tool schemas use in practice (type, properties, required, enum,
const, items, additionalProperties, min/max bounds); anything else is not
checked, so the check errs on the side of letting a call through.
"""

from __future__ import annotations

from typing import Any

__all__ = ["schema_errors"]

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list, tuple),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def schema_errors(schema: Any, value: Any, where: str = "arguments") -> list[str]:
    """What is wrong with ``value`` under ``schema`` (empty when nothing is)."""
    if not isinstance(schema, dict):
        return []
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        if not any(_is(value, name) for name in names if isinstance(name, str)):
            return [f"{where}: expected {' or '.join(map(str, names))}, got {_kind(value)}"]
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']!r}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: must be {schema['const']!r}")
    if isinstance(value, dict):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        for name in schema.get("required") or ():
            if isinstance(name, str) and name not in value:
                errors.append(f"{where}: missing required property {name!r}")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                errors.extend(schema_errors(properties[key], item, f"{where}.{key}"))
            elif extra is False:
                errors.append(f"{where}: unexpected property {key!r}")
            elif isinstance(extra, dict):
                errors.extend(schema_errors(extra, item, f"{where}.{key}"))
    elif isinstance(value, list | tuple) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors.extend(schema_errors(schema["items"], item, f"{where}[{i}]"))
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int | float) and value < low:
            errors.append(f"{where}: {value} is below the minimum {low}")
        if isinstance(high, int | float) and value > high:
            errors.append(f"{where}: {value} is above the maximum {high}")
    if isinstance(value, str):
        shortest, longest = schema.get("minLength"), schema.get("maxLength")
        if isinstance(shortest, int) and len(value) < shortest:
            errors.append(f"{where}: shorter than {shortest} characters")
        if isinstance(longest, int) and len(value) > longest:
            errors.append(f"{where}: longer than {longest} characters")
    return errors


def _is(value: Any, name: str) -> bool:
    types = _TYPES.get(name)
    if types is None:
        return True  # a type this check does not know: not ours to refuse
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, types)


def _kind(value: Any) -> str:
    for name in _TYPES:
        if name != "number" and _is(value, name):
            return name
    return type(value).__name__
