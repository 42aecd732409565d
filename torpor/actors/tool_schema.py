"""From an async function's signature to a msgspec arguments Struct and its JSON schema.

One Struct does both jobs: msgspec renders its JSON schema for the model and
validates the model's arguments against the very same types, so what the
model is told and what is checked cannot drift apart.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from torpor.actors.tool_context import ToolContext
from torpor.errors import ConfigError

__all__ = ["DerivedSignature", "check_tool_name", "derive_signature"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI and Anthropic both accept
_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters|Params):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+):\s*(.*)$")


def check_tool_name(name: str) -> str:
    """Tool names must be what providers accept; a bad one fails at configuration time."""
    if not _NAME.match(name):
        raise ConfigError(
            "tools", f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'"
        )
    return name


@dataclass(frozen=True, slots=True)
class DerivedSignature:
    arguments_type: type[msgspec.Struct]
    parameters: dict[str, Any]  # JSON schema of the arguments object
    description: str  # the docstring's first paragraph
    summary: str  # "x: int, flag: bool = False", quoted back to the model on bad arguments
    context: str | None = None  # the parameter that gets the ToolContext (not in the schema)


def _split_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """The first paragraph, and per-parameter descriptions (Google or Sphinx style)."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip():
            break
        first.append(line.strip())
    params: dict[str, str] = {}
    current: str | None = None
    arg_indent: int | None = None  # inside an "Args:" section: the indent of its entries
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        sphinx = _SPHINX_PARAM.match(stripped)
        if sphinx:
            current, arg_indent = sphinx.group(1), None
            params[current] = sphinx.group(2)
        elif _ARGS_HEADER.match(stripped):
            current, arg_indent = None, -1
        elif arg_indent is None or not stripped:
            continue
        elif indent == 0:
            current, arg_indent = None, None  # the next section began
        elif (arg_indent in (-1, indent)) and (entry := _ARG_LINE.match(stripped)):
            arg_indent = indent
            current = entry.group(1).lstrip("*")
            params[current] = entry.group(2)
        elif current is not None:
            params[current] = f"{params[current]} {stripped}".strip()
    return " ".join(first), params


def _label(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Annotated:
        return _label(typing.get_args(annotation)[0])
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_label(value: Any) -> str:
    try:
        return repr(msgspec.to_builtins(value))  # an enum member reads as its value
    except TypeError:
        return repr(value)


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn.func if isinstance(fn, functools.partial) else fn


def derive_signature(
    fn: Callable[..., Any], tool_name: str, description: str | None = None
) -> DerivedSignature:
    """Build the arguments Struct and JSON schema of ``fn``; unsupported signatures fail early."""
    def fail(message: str) -> ConfigError:
        return ConfigError("tools", f"tool {tool_name!r}: {message}")

    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(_unwrap(fn), include_extras=True)
    except (NameError, TypeError, ValueError) as exc:
        raise fail(f"cannot read the signature: {exc}") from exc

    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    summary: list[str] = []
    copied_defaults: dict[str, Any] = {}
    context: str | None = None
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise fail(f"parameter {param.name!r} must be passable by keyword ({param.kind})")
        annotation = hints.get(param.name, Any)
        if annotation is ToolContext:  # the runtime's to fill: the model never sees it
            if context is not None:
                raise fail(f"parameters {context!r} and {param.name!r} both ask for the "
                           "ToolContext; one is enough")
            context = param.name
            continue
        if _mentions_context(annotation):
            raise fail(f"parameter {param.name!r}: annotate it exactly ToolContext to get "
                       "the call's context")
        label = f"{param.name}: {_label(annotation)}"
        if param.default is param.empty:
            fields.append((param.name, annotation))
        elif isinstance(param.default, list | dict | set | bytearray) and param.default:
            factory = functools.partial(copy.deepcopy, param.default)
            fields.append((param.name, annotation, msgspec.field(default_factory=factory)))
            copied_defaults[param.name] = param.default
            label += f" = {_default_label(param.default)}"
        else:
            fields.append((param.name, annotation, param.default))
            label += f" = {_default_label(param.default)}"
        summary.append(label)

    struct_name = f"{tool_name}_arguments"
    try:
        arguments_type = msgspec.defstruct(
            struct_name, fields, kw_only=True, forbid_unknown_fields=True
        )
        (_,), components = msgspec.json.schema_components(
            [arguments_type], ref_template="#/$defs/{name}"
        )
        defaults = {k: msgspec.to_builtins(v) for k, v in copied_defaults.items()}
    except (TypeError, ValueError) as exc:
        detail = str(exc).splitlines()[-1] if str(exc) else repr(exc)
        raise fail(f"a parameter type or default cannot be expressed as JSON: {detail}") from exc

    schema = dict(components.pop(struct_name))
    schema.pop("title", None)
    first_paragraph, param_docs = _split_docstring(inspect.getdoc(_unwrap(fn)))
    properties: dict[str, Any] = schema.setdefault("properties", {})
    for name, prop in properties.items():
        if name in defaults:
            prop["default"] = defaults[name]
        if name in param_docs and "description" not in prop:
            prop["description"] = param_docs[name]
    if components:
        schema["$defs"] = components
    return DerivedSignature(
        arguments_type=arguments_type,
        parameters=schema,
        description=first_paragraph if description is None else description,
        summary=", ".join(summary),
        context=context,
    )


def _mentions_context(annotation: Any) -> bool:
    """``ToolContext | None``, ``Annotated[ToolContext, ...]`` and such: not filled in, and
    not JSON either, so refused with a message that says what to write instead."""
    return any(
        arg is ToolContext or _mentions_context(arg) for arg in typing.get_args(annotation)
    )
