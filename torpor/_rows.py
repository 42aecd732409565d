"""Records stored as msgpack arrays, read back whether stored as arrays or as maps.

Audit rows and recipes are written once per model call. Encoded as maps they
carried every field's name in every row: an audit row was about 810 bytes, more
than half of it names, and a commit writes each page it fills. As arrays (the
struct's fields in order) the same row is about 340 bytes. Rows written before
are maps and still decode: the first byte tells the two apart. A field added
later goes last, with a default, so an older, shorter array decodes too.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

__all__ = ["ArrayRows"]

S = TypeVar("S", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()


def _is_array(data: bytes) -> bool:
    first = data[0] if data else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)  # fixarray, array 16, array 32


class ArrayRows(Generic[S]):
    """Encoding and decoding of one struct type as array rows (map rows still read)."""

    __slots__ = ("_array", "_map", "_type")

    def __init__(self, struct: type[S]) -> None:
        self._type = struct
        self._map = msgspec.msgpack.Decoder(struct)
        # The same fields, read positionally: only for decoding.
        rows: Any = msgspec.defstruct(
            f"_{struct.__name__}Row", [], bases=(struct,), array_like=True
        )
        self._array: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(rows)

    def encode(self, value: S) -> bytes:
        return _encoder.encode(msgspec.structs.astuple(value))

    def decode(self, data: bytes) -> S:
        """Raises msgspec.DecodeError / ValidationError as the decoders do."""
        if not _is_array(data):
            return self._map.decode(data)
        row = self._array.decode(data)
        return self._type(**msgspec.structs.asdict(row))
