"""Embedders: text to vectors, for hybrid recall (see :mod:`torpor.compaction.fusion`).

An :class:`Embedder` names its vector space (``name``, which should carry the
model and its version) and its ``dimensions``; stored vectors are kept under
``space_of(embedder)`` and a search compares only vectors of one space, so
switching models never mixes vectors that mean different things.

:class:`HashingEmbedder` is a small deterministic embedder (hashed words and
character trigrams, no model, no network) for tests and demos: it matches
words that share stems or spelling ("deploying" and "deployment") where
full-text search matches whole tokens only.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torpor.errors import ConfigError, ModelResponseError

__all__ = ["Embedder", "HashingEmbedder", "check_embedder", "check_vectors", "space_of"]


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into vectors of ``dimensions`` floats, one per text, in order.

    ``name`` identifies the vector space (model and version: ``"openai:text-
    embedding-3-small"``); vectors made under another name are never compared
    with this one's. ``embed`` may raise a :class:`~torpor.errors.ModelError`;
    the runtime retries later, it never blocks a turn on it.
    """

    @property
    def name(self) -> str: ...

    @property
    def dimensions(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def space_of(embedder: Embedder) -> str:
    """The key stored vectors are kept under: the embedder's name and dimensions."""
    return f"{embedder.name}/{embedder.dimensions}"


def check_embedder(value: object) -> str | None:
    """What is wrong with ``value`` as an embedder (None: nothing)."""
    try:
        name = getattr(value, "name", None)
        dimensions = getattr(value, "dimensions", None)
        embed = getattr(value, "embed", None)
    except Exception:  # a hostile __getattr__ is a bad embedder, not a crash
        return "its attributes raise"
    if not isinstance(name, str) or not name:
        return "no non-empty str 'name'"
    if type(dimensions) is not int or not 1 <= dimensions <= 65_536:
        return "no int 'dimensions' from 1 to 65536"
    if not callable(embed):
        return "no async 'embed' method"
    return None


def check_vectors(embedder: Embedder, texts: Sequence[str], vectors: object) -> list[list[float]]:
    """The embedder's answer if it is one finite vector of the right size per text."""
    name = embedder.name
    if not isinstance(vectors, list) or len(vectors) != len(texts):
        got = len(vectors) if isinstance(vectors, list) else type(vectors).__name__
        raise ModelResponseError(f"{name}: {got} vectors for {len(texts)} texts", provider=name)
    for vector in vectors:
        if not isinstance(vector, list) or len(vector) != embedder.dimensions:
            raise ModelResponseError(
                f"{name}: a vector is not {embedder.dimensions} floats", provider=name
            )
        if not all(isinstance(x, float | int) and math.isfinite(x) for x in vector):
            raise ModelResponseError(f"{name}: a vector holds a non-finite value", provider=name)
    return vectors


_WORD = re.compile(r"[^\W_]+")


class HashingEmbedder:
    """Hashed set of words and character trigrams (signed feature hashing), L2-normalised.

    Deterministic across processes and platforms (CRC-32, not ``hash()``), so a
    test or a demo gets the same vectors every run. Not a language model: it
    relates words that share spelling, not synonyms.
    """

    def __init__(self, dimensions: int = 256, *, name: str = "torpor:hashing-v1") -> None:
        if type(dimensions) is not int or not 8 <= dimensions <= 65_536:
            raise ConfigError("dimensions", f"must be an int from 8 to 65536, got {dimensions!r}")
        self.dimensions = dimensions
        self.name = name

    def vector(self, text: str) -> list[float]:
        # Each distinct feature counts once: a word repeated does not outweigh the rest.
        features: dict[str, float] = {}
        for word in _WORD.findall(text.lower()):
            features["w:" + word] = 1.0
            padded = f"<{word}>"
            for i in range(len(padded) - 2):
                features.setdefault(padded[i : i + 3], 0.5)
        out = [0.0] * self.dimensions
        for feature, weight in features.items():
            self._add(out, feature, weight)
        norm = math.sqrt(sum(x * x for x in out))
        return [x / norm for x in out] if norm else out

    def _add(self, out: list[float], feature: str, weight: float) -> None:
        h = zlib.crc32(feature.encode())
        out[h % self.dimensions] += weight if h & 0x8000_0000 else -weight

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.vector(text) for text in texts]

    def __repr__(self) -> str:
        return f"HashingEmbedder(dimensions={self.dimensions}, name={self.name!r})"
