"""Derived memory as rows: the encoding both backends share, and the record they assemble.

Each table keeps the struct as a msgpack body beside the few columns its
primary key and its pruning need, like checkpoints and model calls do: one
decoder per table, and a row that does not decode is a CorruptEvent naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from torpor.errors import CorruptEvent
from torpor.store.memory import EpisodicItem, LedgerEntry, MemoryRecord, SemanticItem

__all__ = [
    "LEDGER_TAIL",
    "MemoryWrite",
    "decode_row",
    "encode_row",
    "named_items",
    "record",
]

LEDGER_TAIL = 256
"""Ledger rows kept per conversation beyond the latest decision of each key."""

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(kind) for kind in (EpisodicItem, SemanticItem, LedgerEntry)
}


class MemoryWrite(msgspec.Struct, frozen=True, gc=False):
    """One conversation's derived-memory rows, backend-neutral (the backend adds its key)."""

    conversation_id: str
    episodes: tuple[tuple[int, int, bytes], ...] = ()  # position, created_at, body
    facts: tuple[tuple[int, int, str, int, bytes], ...] = ()  # position, ordinal, key, at, body
    ledger: tuple[tuple[str, int, bytes], ...] = ()  # key, created_at, body
    turns: tuple[tuple[int, str, int], ...] = ()  # turn, decision, created_at
    prune_tail: int | None = None  # prune the ledger afterwards, keeping this tail
    # First drop the items at positions after this one that no checkpoint backs (the
    # leftovers of a fold that never landed).
    replace_after: int | None = None
    # Items the ledger rows name that must be stored, or nothing is written (a sweep's
    # decisions, read before a redaction dropped some: torpor.memory.consolidate):
    # facts as (position, ordinal), episodes as (position, -1).
    named: tuple[tuple[int, int], ...] = ()


def named_items(entries: Iterable[LedgerEntry]) -> tuple[tuple[int, int], ...] | None:
    """The items ``entries`` name, as :attr:`MemoryWrite.named` wants them; None when one
    is no item id at all (``<position>.<ordinal>`` or ``episode:<position>``)."""
    found: set[tuple[int, int]] = set()
    for entry in entries:
        for item in (entry.item, *entry.superseded):
            position, dot, ordinal = item.removeprefix("episode:").partition(".")
            episode = item.startswith("episode:")
            if not position.isdigit() or (episode and dot) or (
                not episode and not (dot and ordinal.isdigit())
            ):
                return None
            found.add((int(position), -1 if episode else int(ordinal)))
    return tuple(sorted(found))


def encode_row(item: EpisodicItem | SemanticItem | LedgerEntry) -> bytes:
    return _encoder.encode(item)


def decode_row(kind: type[Any], conversation_id: str, where: int, data: bytes) -> Any:
    try:
        return _decoders[kind].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEvent(
            conversation_id, where, f"{kind.__name__} row does not decode: {exc}"
        ) from exc


def record(
    conversation_id: str,
    episodes: Iterable[tuple[int, bytes]],
    facts: Iterable[tuple[int, bytes]],
    ledger: Iterable[tuple[int, bytes]],
    skipped: Iterable[int],
) -> MemoryRecord:
    """The record from rows already in order: (position, body) and (seq, body)."""
    return MemoryRecord(
        conversation_id=conversation_id,
        episodes=tuple(decode_row(EpisodicItem, conversation_id, p, b) for p, b in episodes),
        facts=tuple(decode_row(SemanticItem, conversation_id, p, b) for p, b in facts),
        ledger=tuple(
            msgspec.structs.replace(decode_row(LedgerEntry, conversation_id, -1, b), seq=seq)
            for seq, b in ledger
        ),
        skipped_turns=tuple(int(t) for t in skipped),
    )
