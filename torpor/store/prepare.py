"""Turn an ``append`` call into rows, on the caller's side, before anything is queued.

Everything that can refuse an append without looking at the database happens
here (bad ids, empty batches, oversized bodies), so a refused append never
reaches the writer and never shares a transaction with anyone. Large tool
results are clipped on entry: the row keeps a preview, the full text goes to an
artifact written in the same transaction, and full-text search indexes the full
text so a string beyond the preview is still found.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from torpor.errors import ConfigError, EventTooLarge
from torpor.events import Body, ToolResult, encode_body, kind_of, searchable_text
from torpor.store.protocol import TokenCounter

__all__ = [
    "MAX_ID_LENGTH",
    "PREVIEW_BYTES",
    "AppendPolicy",
    "PreparedAppend",
    "PreparedEvent",
    "check_conversation_id",
    "estimate_tokens",
    "new_artifact_id",
    "now_ms",
]

MAX_ID_LENGTH = 256
PREVIEW_BYTES = 1024


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_artifact_id() -> str:
    """Random and opaque; ``art-`` makes it recognisable in a clipped preview."""
    return "art-" + uuid.uuid4().hex


def check_conversation_id(conversation_id: object) -> str:
    if not isinstance(conversation_id, str):
        raise ValueError(f"conversation id must be a str, got {type(conversation_id).__name__}")
    if not conversation_id or len(conversation_id) > MAX_ID_LENGTH:
        raise ValueError(
            f"conversation id must be 1..{MAX_ID_LENGTH} characters, got {len(conversation_id)}"
        )
    return conversation_id


def estimate_tokens(body: Body) -> int:
    """The default counter: about four bytes a token, plus a little role framing.

    Cheap on purpose; the runtime injects a tiktoken counter when it has one.
    """
    return len(searchable_text(body).encode()) // 4 + 4


class PreparedEvent(msgspec.Struct, frozen=True, gc=False):
    """One event ready to insert (msgspec: constructed per event, on the hot path)."""

    kind: str
    turn: int
    tokens: int
    created_at: int
    value: Body  # the body as stored (clipped)
    body: bytes  # msgpack of ``value``
    text: str  # what full-text search indexes (full text, even when clipped)
    artifact_id: str | None = None
    artifact_data: bytes | None = None  # the full content, utf-8, uncompressed


class PreparedAppend(msgspec.Struct, frozen=True, gc=False):
    conversation_id: str
    events: tuple[PreparedEvent, ...]
    expect_head: int | None
    key: str | None


@dataclass(frozen=True, slots=True)
class AppendPolicy:
    """How bodies are measured, clipped and refused; one per store."""

    token_counter: TokenCounter | None = None  # None: estimate_tokens
    artifact_threshold: int = 16 * 1024
    max_event_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        if self.artifact_threshold < PREVIEW_BYTES:
            raise ConfigError(
                "artifact_threshold", f"must be at least {PREVIEW_BYTES} bytes (the preview size)"
            )
        if self.max_event_bytes < 2 * PREVIEW_BYTES:
            raise ConfigError("max_event_bytes", f"must be at least {2 * PREVIEW_BYTES} bytes")

    def prepare(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int,
        expect_head: int | None,
        key: str | None,
    ) -> PreparedAppend:
        check_conversation_id(conversation_id)
        if type(events) not in (list, tuple) and (
            isinstance(events, str | bytes) or not isinstance(events, Sequence)
        ):
            raise TypeError("events must be a sequence of event bodies")
        if not events:
            raise ValueError("an append needs at least one event")
        if type(turn) is not int or turn < 0:
            raise ValueError(f"turn must be a non-negative int, got {turn!r}")
        if expect_head is not None and (type(expect_head) is not int or expect_head < -1):
            raise ValueError(f"expect_head must be None, -1 or a position, got {expect_head!r}")
        if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_ID_LENGTH):
            raise ValueError(f"idempotency key must be 1..{MAX_ID_LENGTH} characters")
        created = now_ms()
        prepared = tuple([self._prepare_one(body, turn, created) for body in events])
        return PreparedAppend(conversation_id, prepared, expect_head, key)

    def _prepare_one(self, body: Body, turn: int, created: int) -> PreparedEvent:
        try:
            kind = kind_of(body)
        except KeyError:
            raise TypeError(f"not an event body: {type(body).__name__}") from None
        text = searchable_text(body)
        stored_text = text  # the text of the body as stored (differs once clipped)
        artifact_id: str | None = None
        artifact_data: bytes | None = None
        if type(body) is ToolResult and body.artifact is None:
            full = body.content.encode()
            if len(full) > self.artifact_threshold:
                artifact_id = new_artifact_id()
                artifact_data = full
                body = clip_tool_result(body, full, artifact_id)
                stored_text = searchable_text(body)
        encoded = encode_body(body)
        if len(encoded) > self.max_event_bytes:
            raise EventTooLarge(len(encoded), self.max_event_bytes)
        if self.token_counter is None:
            tokens = len(stored_text.encode()) // 4 + 4  # estimate_tokens, text already at hand
        else:
            tokens = self.token_counter(body)
        return PreparedEvent(
            kind, turn, tokens, created, body, encoded, text, artifact_id, artifact_data
        )


def clip_tool_result(body: ToolResult, full: bytes, artifact_id: str) -> ToolResult:
    """Keep the first ~1 KiB and say where the rest is, so a reader knows it was clipped."""
    head = full[:PREVIEW_BYTES].decode("utf-8", "ignore")
    note = f"\n[… clipped: {len(full):,} bytes in total; the full text is artifact {artifact_id}]"
    return ToolResult(
        call_id=body.call_id,
        tool=body.tool,
        content=head + note,
        is_error=body.is_error,
        artifact=artifact_id,
        full_size=len(full),
    )
