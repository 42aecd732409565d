"""Clip on entry: a body too large for a row keeps a preview, the full text goes to an artifact.

Two rules, one mechanism:

* a tool result whose content exceeds the store's ``artifact_threshold``
  (16 KiB) is clipped, because an old result is rarely read again in full and
  the working set should not carry it;
* an assistant message (or an aborted turn's partial text) is clipped only when
  its row would exceed ``max_event_bytes`` (1 MiB): the model sees its own
  earlier answers in later context, so an ordinary long answer stays verbatim,
  and an answer too large for a row is still kept (issue 8, item 7), never
  dropped.

The artifact is written in the same transaction as the row; full-text search
indexes the full text; :func:`expanded` puts it back for ``expand``.
"""

from __future__ import annotations

import msgspec

from torpor.events import Aborted, AssistantMessage, Body, ToolResult

__all__ = [
    "PREVIEW_BYTES",
    "artifact_of",
    "clip_aborted",
    "clip_assistant",
    "clip_tool_result",
    "expanded",
]

PREVIEW_BYTES = 1024


def _preview(full: bytes, artifact_id: str) -> str:
    """The first ~1 KiB and where the rest is, so a reader knows it was clipped."""
    head = full[:PREVIEW_BYTES].decode("utf-8", "ignore")
    note = f"[… clipped: {len(full):,} bytes in total; the full text is artifact {artifact_id}]"
    return f"{head}\n{note}"


def clip_tool_result(body: ToolResult, full: bytes, artifact_id: str) -> ToolResult:
    return msgspec.structs.replace(
        body, content=_preview(full, artifact_id), artifact=artifact_id, full_size=len(full)
    )


def clip_assistant(body: AssistantMessage, full: bytes, artifact_id: str) -> AssistantMessage:
    """Only the text is clipped: the tool calls stay whole (they are what the turn does next)."""
    return msgspec.structs.replace(
        body, text=_preview(full, artifact_id), artifact=artifact_id, full_size=len(full)
    )


def clip_aborted(body: Aborted, full: bytes, artifact_id: str) -> Aborted:
    return msgspec.structs.replace(
        body, partial_text=_preview(full, artifact_id), artifact=artifact_id, full_size=len(full)
    )


def artifact_of(body: Body) -> str | None:
    """The artifact holding the full text of a clipped body, or None."""
    if isinstance(body, ToolResult | AssistantMessage | Aborted):
        return body.artifact
    return None


def expanded(body: Body, full: str) -> Body:
    """``body`` with its full text put back (``artifact`` and ``full_size`` stay, as a record)."""
    if isinstance(body, ToolResult):
        return msgspec.structs.replace(body, content=full)
    if isinstance(body, AssistantMessage):
        return msgspec.structs.replace(body, text=full)
    if isinstance(body, Aborted):
        return msgspec.structs.replace(body, partial_text=full)
    return body
