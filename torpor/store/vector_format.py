"""How vectors are kept: unit length, as float32 bytes; shared by the vector backends.

Not in :mod:`torpor.store.vectors`, which picks a backend and so imports the
backends: a backend importing these from there would make an import cycle.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

from torpor.errors import ConfigError

__all__ = ["Vectors", "from_blob", "to_blob", "unit"]

Vectors = Sequence[tuple[int, Sequence[float]]]
"""(position, vector) pairs of one conversation."""


def unit(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to length 1 (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm else [float(x) for x in vector]


def to_blob(vector: Sequence[float]) -> bytes:
    """Little-endian float32 bytes (sqlite-vec's format for a ``float[]`` vector)."""
    values = array("f", vector)
    if values.itemsize != 4:  # pragma: no cover - no such platform in practice
        raise ConfigError("vector", "float is not 32-bit on this platform")
    return values.tobytes()


def from_blob(blob: bytes) -> array[float]:
    values = array("f")
    values.frombytes(blob)
    return values
