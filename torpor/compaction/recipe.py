"""What a rendered context is made of, and the recipe that rebuilds it from the log.

A model call stores the recipe (small: positions, not text) and a hash of the
rendered payload. Rebuilding from the log with the recipe must give the same
hash; that is how an operator answers "why did it forget X" after the fact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import msgspec

from torpor.compaction.tokens import DEFAULT_ENCODING
from torpor.llm.protocol import ContextMessage, ToolSpec

__all__ = ["Recipe", "Rendered", "decode_recipe", "encode_recipe", "payload_hash", "text_hash"]

RECIPE_VERSION = 1


class Recipe(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Every decision assembly took, by log position, so the log can replay it.

    ``stubbed``: events rendered as a short pointer (old tool results, and
    anything stubbed to get under the hard ceiling). ``clipped``: (position,
    tokens kept) for oversized messages. ``dropped``: events left out entirely
    (orphaned tool results, or whole turns dropped to fit the ceiling).
    ``synthesized``: tool call ids answered with an interrupted-result stand-in.
    ``tail_start``/``tail_end``: the lowest and highest tail positions.
    """

    checkpoint_position: int | None
    cycle: int
    tail_start: int | None
    tail_end: int | None
    stubbed: tuple[int, ...] = ()
    clipped: tuple[tuple[int, int], ...] = ()
    dropped: tuple[int, ...] = ()
    synthesized: tuple[str, ...] = ()
    ceiling_enforced: bool = False  # the tail had to be cut further to fit the ceiling
    system_hash: str = ""
    tools: tuple[str, ...] = ()
    encoding: str = DEFAULT_ENCODING
    version: int = RECIPE_VERSION
    # The call's turn: a rebuild keeps events of turns up to it, in turn order (a user
    # message postponed behind this turn may sit inside the position range).
    turn: int | None = None


class Rendered(msgspec.Struct, frozen=True, gc=False):
    """A context ready to send: the messages, how they were made, and what they cost."""

    messages: list[ContextMessage]
    recipe: Recipe
    hash: str  # sha256 hex of the msgpack encoding of (messages, tool specs)
    sections: dict[str, int]  # tokens: system, markers, tools, tail, tool_results, user
    estimated_tokens: int


_recipe_encoder = msgspec.msgpack.Encoder()
_recipe_decoder = msgspec.msgpack.Decoder(Recipe)
_payload_encoder = msgspec.msgpack.Encoder(order="deterministic")


def encode_recipe(recipe: Recipe) -> bytes:
    return _recipe_encoder.encode(recipe)


def decode_recipe(data: bytes) -> Recipe:
    return _recipe_decoder.decode(data)


def payload_hash(messages: Sequence[ContextMessage], tools: Sequence[ToolSpec]) -> str:
    """sha256 of exactly what the model is given (dict keys sorted, so order-proof)."""
    return hashlib.sha256(_payload_encoder.encode((messages, tuple(tools)))).hexdigest()


@lru_cache(maxsize=256)
def text_hash(text: str) -> str:
    """sha256 hex of a text (the system prompt, recorded in recipes); cached, prompts repeat."""
    return hashlib.sha256(text.encode()).hexdigest()
