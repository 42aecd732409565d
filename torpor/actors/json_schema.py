"""The JSON Schema check for the arguments of externally answered tool calls.

Local tools validate through their msgspec Struct. An ``ExternalTool`` is
described by a hand-written JSON schema instead, and a call whose arguments
break it is answered with an error result at once (the model can fix it)
rather than suspending a turn on a call nobody can act on.

The check is ``jsonschema``'s, Draft 2020-12 unless the schema's ``$schema``
names another draft: a maintained validator gets ``enum``/``const`` (``True``
is not ``1``), ``pattern``, ``anyOf``, ``$ref`` and ``prefixItems`` right
where a hand-written subset did not. A schema is checked once, when its tool
is defined (:func:`check_schema`, a :class:`~torpor.errors.ConfigError` then,
never at call time), and its compiled validator is kept per schema object.
Only references inside the schema resolve: nothing is ever fetched.

``jsonschema`` is imported on the first schema, not with torpor (it adds
70-100 ms to the import, paid only by agents with external tools).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torpor.errors import ConfigError

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator
    from referencing import Registry

__all__ = ["check_schema", "schema_errors"]

_CACHE_SIZE = 256  # schema objects; past it the least recently used is compiled again
# Keyed by id(): schemas are dicts (not hashable). The entry holds the schema itself, so
# its id cannot be reused by another object while the entry lives.
_compiled: OrderedDict[int, tuple[object, Validator]] = OrderedDict()
_DATA = frozenset({"const", "default", "enum", "examples"})  # values, not subschemas
_MESSAGE_CHARS = 200  # a message quotes the value: a huge argument is not echoed whole


def check_schema(schema: Any, what: str = "parameters") -> None:
    """Raise ConfigError (field ``tools``, the message starting with ``what``) unless
    ``schema`` is a valid JSON schema whose references resolve.

    Also compiles and caches its validator, so the first call pays nothing more.
    """
    _validator(schema, what)


def schema_errors(schema: Any, value: Any, where: str = "arguments") -> list[str]:
    """What is wrong with ``value`` under ``schema``, each naming its path (empty: nothing).

    An invalid ``schema`` raises ConfigError (a tool's is checked when it is defined).
    """
    from referencing.exceptions import Unresolvable

    validator = _validator(schema, "parameters")
    try:
        return [_describe(error, where) for error in validator.iter_errors(value)]
    except Unresolvable as exc:  # only if the schema changed since it was checked
        return [f"{where}: the tool's schema has a reference that does not resolve: {exc}"]


def _validator(schema: Any, what: str) -> Validator:
    key = id(schema)
    hit = _compiled.get(key)
    if hit is not None and hit[0] is schema:
        _compiled.move_to_end(key)
        return hit[1]
    validator = _compile(schema, what)
    _compiled[key] = (schema, validator)
    if len(_compiled) > _CACHE_SIZE:
        _compiled.popitem(last=False)
    return validator


def _fail(what: str, message: str) -> ConfigError:
    return ConfigError("tools", f"{what}: {message}")


def _compile(schema: Any, what: str) -> Validator:
    from jsonschema import Draft202012Validator, validators
    from jsonschema.exceptions import SchemaError
    from referencing import Registry

    if not isinstance(schema, dict):
        raise _fail(what, f"a JSON schema must be an object, got {type(schema).__name__}")
    if "$schema" in schema:
        cls = validators.validator_for(schema, default=None)  # type: ignore[arg-type]
        if cls is None:
            raise _fail(what, f"unknown $schema {schema['$schema']!r}")
    else:
        cls = Draft202012Validator
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        path = "".join(_step(p) for p in exc.absolute_path)
        at = f"at {path[1:]}" if path else "at the top"
        raise _fail(what, f"not a valid JSON schema: {_clip(exc.message)} ({at})") from None
    local: Registry[Any] = Registry()  # no retrieval: a reference never fetches anything
    _check_refs(schema, what, local)
    return cls(schema, registry=local)


def _check_refs(schema: dict[str, Any], what: str, registry: Registry[Any]) -> None:
    """Every ``$ref`` resolves within the schema: a dangling one fails now, not at a call."""
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012, specification_with

    dialect = schema.get("$schema")
    spec = DRAFT202012
    if isinstance(dialect, str):
        spec = specification_with(dialect, default=DRAFT202012)
    resolver = registry.resolver_with_root(spec.create_resource(schema))
    for ref, at in _refs(schema, resolver, spec):
        try:
            at.lookup(ref)
        except Unresolvable:
            raise _fail(
                what, f"$ref {ref!r} does not resolve within the schema (nothing is fetched)"
            ) from None


def _refs(node: Any, resolver: Any, spec: Any) -> Iterator[tuple[str, Any]]:
    """Each ``$ref`` string of the schema, with the resolver of its base (``$id``)."""
    if isinstance(node, list):
        for item in node:
            yield from _refs(item, resolver, spec)
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("$id"), str):  # a new base for the references below it
        resolver = resolver.in_subresource(spec.create_resource(node))
    ref = node.get("$ref")
    if isinstance(ref, str):
        yield ref, resolver
    for key, item in node.items():
        if key not in _DATA:
            yield from _refs(item, resolver, spec)


def _describe(error: ValidationError, where: str) -> str:
    path = "".join(_step(p) for p in error.absolute_path)
    return f"{where}{path}: {_clip(error.message)}"


def _step(part: str | int) -> str:
    return f"[{part}]" if isinstance(part, int) else f".{part}"


def _clip(text: str) -> str:
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 1] + "…"
