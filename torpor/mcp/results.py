"""An MCP tool's answer as the text a model reads.

Text parts are the result, joined by newlines; a part the model cannot read as text
(an image, audio, a binary resource) is one line saying what it was and how big, so the
model knows it was there without a megabyte of base64 in its context. Structured
content stands in when there is no content at all. A large text is not cut here: the
store clips it on entry into a preview plus an artifact, as for a local tool's result.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec

__all__ = ["render_result"]


def _decoded_size(data: str) -> int:
    try:
        return len(base64.b64decode(data, validate=False))
    except (binascii.Error, ValueError):
        return len(data)


def _part(item: Any) -> str:
    kind = getattr(item, "type", None)
    if kind == "text":
        return str(item.text)
    if kind in ("image", "audio"):
        size = _decoded_size(item.data)
        return f"[{kind} content: {item.mime_type or 'unknown type'}, {size} bytes]"
    if kind == "resource_link":
        sized = f", {item.size} bytes" if getattr(item, "size", None) is not None else ""
        mime = f", {item.mime_type}" if getattr(item, "mime_type", None) else ""
        return f"[resource link: {item.uri} ({item.name}{mime}{sized})]"
    if kind == "resource":
        resource = item.resource
        text = getattr(resource, "text", None)
        mime = f", {resource.mime_type}" if getattr(resource, "mime_type", None) else ""
        if isinstance(text, str):
            return f"[resource {resource.uri}{mime}]\n{text}"
        blob = getattr(resource, "blob", "")
        return f"[resource {resource.uri}{mime}, {_decoded_size(blob)} bytes]"
    return f"[{kind or type(item).__name__} content]"


def render_result(result: Any) -> tuple[str, bool]:
    """(text, is_error) of a ``CallToolResult``."""
    parts = [_part(item) for item in result.content or ()]
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(msgspec.json.encode(structured).decode())
    return "\n".join(parts), bool(result.is_error)
