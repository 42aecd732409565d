"""Turn an ``append`` call into rows, on the caller's side, before anything is queued.

Everything that can refuse an append without looking at the database happens
here (bad ids, text the log cannot hold, empty batches, oversized bodies), so a
refused append never reaches the writer and never shares a transaction with
anyone. Bodies too large for a row are clipped on entry (:mod:`.clip`): the
row keeps a preview, the full text goes to an artifact written in the same
transaction, and full-text search indexes the full text so a string beyond the
preview is still found.

Measuring a body (its token count, its hints) costs time in proportion to its
text, up to a few hundred milliseconds for a megabyte. An append whose text is
longer than ``AppendPolicy.inline_text`` characters is therefore refused here
with :class:`OffLoop` when prepared on the event loop; the store prepares it
again on a worker thread (``inline=False``), where nothing is refused for its
size (see :class:`~torpor.store.core.StoreCore`).

A keyed append also gets a *fingerprint* of its first body (the message the
key is for), stored with the key, so a retry with the same key is recognised
as the same request and a reuse of the key for a different message is refused
(IdempotencyConflict).
"""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from torpor.errors import ConfigError, EventTooLarge, InvalidInput
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    ToolResult,
    UserMessage,
    encode_body,
    kind_of,
    searchable_text,
)
from torpor.store.admit import check_body
from torpor.store.arguments import (
    INT32_LIMIT,
    MAX_ID_LENGTH,
    POSITION_LIMIT,
    check_conversation_id,
    check_count,
    check_int,
    check_key,
    check_turn,
)
from torpor.store.clip import PREVIEW_BYTES, clip_aborted, clip_assistant, clip_tool_result
from torpor.store.listing import first_title
from torpor.store.normalise import index_form
from torpor.store.open_work import WorkChange, work_change
from torpor.store.protocol import HintExtractor, TokenCounter
from torpor.store.schedules import Firing

__all__ = [
    "MAX_ID_LENGTH",
    "PREVIEW_BYTES",
    "INLINE_TEXT",
    "AppendPolicy",
    "OffLoop",
    "PreparedAppend",
    "PreparedEvent",
    "check_conversation_id",
    "clip_tool_result",
    "estimate_tokens",
    "fingerprint",
    "new_artifact_id",
    "now_ms",
]


INLINE_TEXT = 64 * 1024
"""Characters of text an append may hold and still be measured on the event loop: 5-7 ms
of token counting at most (measured on a 2-core VM, natural text and letters alone)."""


class OffLoop(Exception):  # a signal between the policy and the store, not an error
    """:meth:`AppendPolicy.prepare` on the loop: this append is too long to measure here.

    Never reaches a caller: the store catches it and prepares the append on a thread.
    """


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_artifact_id() -> str:
    """Random and opaque; ``art-`` makes it recognisable in a clipped preview."""
    return "art-" + uuid.uuid4().hex


def fingerprint(body: bytes) -> bytes:
    """What identifies a keyed append: a hash of its first body as the caller gave it.

    The first body only, because that is what a key stands for (the user's
    message): a retry may carry fewer or other events after it and is still
    the same request. Over the msgpack encoding of the body before clipping, so
    a body clipped into an artifact (whose id is random) still matches.
    """
    return hashlib.blake2b(body, digest_size=16).digest()


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
    text: str  # what full-text search indexes: index_form of the full text (even when clipped)
    artifact_id: str | None = None  # set when this append clipped the body
    artifact_data: bytes | None = None  # the full content, utf-8, uncompressed
    hints: bytes | None = None  # the hint extractor's bytes for ``value`` (None: no extractor)


class PreparedAppend(msgspec.Struct, frozen=True, gc=False):
    conversation_id: str
    events: tuple[PreparedEvent, ...]
    expect_head: int | None
    key: str | None
    fingerprint: bytes | None = None  # of the first body, when keyed
    work: WorkChange | None = None  # what it changes in the open-work index (store.open_work)
    title: str | None = None  # the default title it brings (store.listing.first_title)
    fired: Firing | None = None  # the schedule this append fires (store.schedules)

    def repeats(self, stored: bytes | None, first_body: bytes | None) -> bool:
        """Whether this keyed append repeats the one stored under its key.

        ``stored`` is that append's fingerprint. Keys stored before fingerprints
        existed (None) compare ``first_body``, the stored first body (the message
        the key was given for), with ours byte for byte.
        """
        if stored is not None:
            return bytes(stored) == self.fingerprint
        first = self.events[0]
        if first.artifact_id is not None or first_body is None:
            return True  # nothing comparable: give the benefit of the doubt, as before
        return bytes(first_body) == first.body

    def result(
        self, first: int, events: tuple[PreparedEvent, ...], with_events: bool
    ) -> list[Any]:
        """What the append returns once ``events`` stand at ``first`` onwards (its own
        events, or those an idempotency key found): their positions, or the events."""
        if not with_events:
            return list(range(first, first + len(events)))
        name = self.conversation_id
        return [
            Event(name, first + i, e.turn, e.tokens, e.created_at, e.value, e.hints)
            for i, e in enumerate(events)
        ]


@dataclass(frozen=True, slots=True)
class AppendPolicy:
    """How bodies are measured, clipped and refused; one per store."""

    token_counter: TokenCounter | None = None  # None: estimate_tokens
    hint_extractor: HintExtractor | None = None  # None: no hints stored (NULL)
    artifact_threshold: int = 16 * 1024
    max_event_bytes: int = 1024 * 1024
    # Longer text (characters, an append's events together) raises OffLoop when prepared
    # inline; None: never (the policy's own callers), as when nothing measures the text.
    inline_text: int | None = None
    _limit: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        measures = self.token_counter is not None or self.hint_extractor is not None
        limit = self.inline_text if measures and self.inline_text is not None else sys.maxsize
        object.__setattr__(self, "_limit", limit)
        if type(self.artifact_threshold) is not int or self.artifact_threshold < PREVIEW_BYTES:
            raise ConfigError(
                "artifact_threshold", f"must be at least {PREVIEW_BYTES} bytes (the preview size)"
            )
        if type(self.max_event_bytes) is not int or self.max_event_bytes < 2 * PREVIEW_BYTES:
            raise ConfigError("max_event_bytes", f"must be at least {2 * PREVIEW_BYTES} bytes")

    def prepare(
        self,
        conversation_id: str,
        events: Sequence[Body],
        *,
        turn: int,
        expect_head: int | None,
        key: str | None,
        created: int = 0,
        inline: bool = True,
    ) -> PreparedAppend:
        """The rows of an append, or an error naming what is wrong with it.

        ``created``: the time to stamp (ms since the epoch; 0: now). ``inline``: on the
        event loop, where an append with more text than ``inline_text`` raises
        :class:`OffLoop` instead of being measured; False on a thread, where none does.
        """
        # The plain arguments of most appends pass these tests inline; anything else goes
        # to the named checks, which raise (or pass) exactly as they would have.
        if not (
            type(conversation_id) is str
            and 0 < len(conversation_id) <= MAX_ID_LENGTH
            and conversation_id.isascii()
            and "\x00" not in conversation_id
        ):
            check_conversation_id(conversation_id)
        if type(events) not in (list, tuple) and (
            isinstance(events, str | bytes) or not isinstance(events, Sequence)
        ):
            raise InvalidInput("events", "must be a sequence of event bodies")
        if not events:
            raise InvalidInput("events", "an append needs at least one event")
        if type(turn) is not int or not 0 <= turn < INT32_LIMIT:
            check_turn(turn)
        if expect_head is not None and (
            type(expect_head) is not int or not -1 <= expect_head < POSITION_LIMIT
        ):
            check_int(expect_head, "expect_head", -1, POSITION_LIMIT)
        if key is not None:
            check_key(key)
        if not created:
            created = now_ms()
        limit = self._limit if inline else sys.maxsize
        if len(events) == 1:  # most appends: one event, no comprehension
            prepared: tuple[PreparedEvent, ...] = (
                self._prepare_one(events[0], "events[0]", turn, created, limit),
            )
        else:
            limit //= len(events)  # each its share: the append's text stays within the limit
            prepared = tuple(
                [
                    self._prepare_one(b, f"events[{i}]", turn, created, limit)
                    for i, b in enumerate(events)
                ]
            )
        mark = None
        if key is not None:
            first = prepared[0]
            mark = fingerprint(first.body if first.artifact_id is None else encode_body(events[0]))
        work = work_change(prepared)
        # Only an append that moves the open-work index can hold a user message.
        title = None if work is None or work[0] < 0 else first_title(events)
        return PreparedAppend(conversation_id, prepared, expect_head, key, mark, work, title)

    def _prepare_one(
        self, body: Body, where: str, turn: int, created: int, limit: int
    ) -> PreparedEvent:
        check_body(body, where)
        kind = kind_of(body)
        # Of the full body, even if it is clipped below (a user or plain assistant message's
        # text is its searchable_text: taken without the call).
        if type(body) is UserMessage or (type(body) is AssistantMessage and not body.tool_calls):
            text = body.text
        else:
            text = searchable_text(body)
        stored_text = text  # the text of the body as stored (differs once clipped)
        text = index_form(text)  # what the index is given (erase.indexed_text rebuilds it)
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
            clipped = _clip_oversized(body)
            if clipped is None:
                raise EventTooLarge(len(encoded), self.max_event_bytes)
            body, artifact_id, artifact_data = clipped
            stored_text = searchable_text(body)
            encoded = encode_body(body)
            if len(encoded) > self.max_event_bytes:  # what is left (tool calls) is still too big
                raise EventTooLarge(len(encoded), self.max_event_bytes)
        if len(stored_text) > limit:  # measured below in proportion to its length
            raise OffLoop
        if self.token_counter is None:
            tokens = len(stored_text.encode()) // 4 + 4  # estimate_tokens, text already at hand
        else:
            tokens = self.token_counter(body)
            if type(tokens) is not int or not 0 <= tokens < INT32_LIMIT:
                check_count(tokens, "token_counter result")
        hints = None
        if self.hint_extractor is not None:
            hints = self.hint_extractor(body)  # of the body as stored, as a fold will see it
            if type(hints) is not bytes:
                raise ConfigError(
                    "hint_extractor", f"must return bytes, returned {type(hints).__name__}"
                )
        return PreparedEvent(
            kind, turn, tokens, created, body, encoded, text, artifact_id, artifact_data, hints
        )


def _clip_oversized(body: Body) -> tuple[Body, str, bytes] | None:
    """Model output too large for a row keeps a preview; caller input (a user message) does not."""
    if type(body) is AssistantMessage and body.artifact is None:
        full = body.text.encode()
        artifact_id = new_artifact_id()
        return clip_assistant(body, full, artifact_id), artifact_id, full
    if type(body) is Aborted and body.artifact is None:
        full = body.partial_text.encode()
        artifact_id = new_artifact_id()
        return clip_aborted(body, full, artifact_id), artifact_id, full
    return None
