"""Rows to records. A row is bytes until it decodes; one that does not is a CorruptEvent."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import msgspec

from torpor.errors import CorruptEvent
from torpor.events import Event, decode_body
from torpor.store.protocol import Checkpoint, ConversationInfo, ModelCall

__all__ = [
    "compress_artifact",
    "EVENT_COLUMNS",
    "decode_checkpoint",
    "decode_model_call",
    "encode_checkpoint",
    "encode_model_call",
    "to_conversation_info",
    "to_events",
]

EVENT_COLUMNS = "position, turn, tokens, created_at, body"
EventRow = tuple[int, int, int, int, bytes]

_checkpoint_encoder = msgspec.msgpack.Encoder()
_checkpoint_decoder = msgspec.msgpack.Decoder(Checkpoint)
_call_decoder = msgspec.msgpack.Decoder(ModelCall)


def to_events(conversation_id: str, rows: Iterable[EventRow]) -> list[Event]:
    return [
        Event(
            conversation_id,
            position,
            turn,
            tokens,
            created_at,
            decode_body(body, conversation_id=conversation_id, position=position),
        )
        for position, turn, tokens, created_at, body in rows
    ]


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    return _checkpoint_encoder.encode(checkpoint)


def decode_checkpoint(conversation_id: str, position: int, data: bytes) -> Checkpoint:
    try:
        return _checkpoint_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(conversation_id, position, f"checkpoint does not decode: {exc}") from exc


def encode_model_call(call: ModelCall) -> bytes:
    return _checkpoint_encoder.encode(call)


def decode_model_call(conversation_id: str, turn: int, data: bytes) -> ModelCall:
    try:
        return _call_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(
            conversation_id, -1, f"model call of turn {turn} does not decode: {exc}"
        ) from exc


ConversationRow = tuple[str, int, int, int | None, int, int]


def to_conversation_info(row: ConversationRow) -> ConversationInfo:
    external_id, head, size, checkpoint_position, created_at, updated_at = row
    return ConversationInfo(
        conversation_id=external_id,
        head=None if head < 0 else head,
        event_count=head + 1,
        checkpoint_position=checkpoint_position,
        bytes=size,
        created_at=created_at,
        updated_at=updated_at,
    )


def compress_artifact(data: bytes) -> bytes:
    """zlib; the fastest level for very large data, so one huge result cannot stall a batch."""
    return zlib.compress(data, 6 if len(data) < (1 << 20) else 1)
