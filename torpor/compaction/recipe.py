"""What a rendered context is made of, and the recipe that rebuilds it from the log.

A model call stores the recipe (small: positions, not text) and a hash of the
rendered payload. Rebuilding from the log with the recipe must give the same
hash; that is how an operator answers "why did it forget X" after the fact.

The hash is a chain over the messages (recipe version 2): ``h0`` is a fixed
seed, ``h(i) = sha256(h(i-1) || msgpack(message i))``, and the payload hash is
``sha256(h(n) || sha256(msgpack(tool specs)))``. A function of the messages and tools
alone, like the version 1 hash (sha256 of msgpack of the whole payload), but
one a caller can carry from call to call: between two calls the context grows
by a few messages and changes in the middle only at a few known moments, so
the render cache (:mod:`torpor.compaction.incremental`) hashes only what is
new or changed instead of the whole context every time. Recipes say which
version made their hash, and a rebuild computes that one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import msgspec

from torpor._rows import ArrayRows
from torpor.compaction.tokens import DEFAULT_ENCODING
from torpor.llm.protocol import ContextMessage, ToolSpec

__all__ = [
    "CHAIN_SEED",
    "RECIPE_VERSION",
    "Recipe",
    "Rendered",
    "chain",
    "chain_end",
    "decode_recipe",
    "encode_recipe",
    "payload_hash",
    "text_hash",
    "tools_digest",
]

RECIPE_VERSION = 3
"""1: the payload hash is sha256 of msgpack((messages, tools)); 2: the hash chain;
3: the same chain, with ~10-token stubs (a rebuild of a version 1 or 2 recipe renders
the ~18-token stubs those calls were sent)."""

CHAIN_SEED = hashlib.sha256(b"torpor rendered context, hash chain v2").digest()


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
    # The task card rendered (the position of its TaskCard event; None: no card), and
    # the recalled section pushed: (position, tokens of its text kept), in the order
    # rendered. Added last, with defaults: older recipes decode as "none".
    task_card: int | None = None
    pushed: tuple[tuple[int, int], ...] = ()


class Rendered(msgspec.Struct, frozen=True, gc=False):
    """A context ready to send: the messages, how they were made, and what they cost."""

    messages: Sequence[ContextMessage]  # a list, or a MessageView sharing the render cache
    recipe: Recipe
    hash: str  # the payload hash (hex) of (messages, tool specs), per the recipe's version
    # tokens: system, markers, tools, tail, tool_results, user (and task_card, recalled
    # when they render)
    sections: dict[str, int]
    estimated_tokens: int


_recipes = ArrayRows(Recipe)  # stored as arrays; maps before (see torpor._rows)
_payload_encoder = msgspec.msgpack.Encoder(order="deterministic")


def encode_recipe(recipe: Recipe) -> bytes:
    return _recipes.encode(recipe)


def decode_recipe(data: bytes) -> Recipe:
    return _recipes.decode(data)


def tools_digest(tools: Sequence[ToolSpec]) -> bytes:
    """sha256 of the tool specs' msgpack: what closes the chain."""
    return hashlib.sha256(_payload_encoder.encode(tuple(tools))).digest()


def chain(state: bytes, message: ContextMessage) -> bytes:
    """The chain state after ``message``, given the state before it."""
    return hashlib.sha256(state + _payload_encoder.encode(message)).digest()


def chain_end(state: bytes, tools: bytes) -> str:
    """The payload hash: the chain state after the last message, closed by the tool specs'
    digest (:func:`tools_digest`)."""
    return hashlib.sha256(state + tools).hexdigest()


def payload_hash(
    messages: Sequence[ContextMessage],
    tools: Sequence[ToolSpec],
    version: int = RECIPE_VERSION,
) -> str:
    """The hash of exactly what the model is given, as recipes of ``version`` record it."""
    if version in (2, 3):  # 3: the same chain; its stubs are the ~10-token ones
        state = CHAIN_SEED
        for message in messages:
            state = chain(state, message)
        return chain_end(state, tools_digest(tools))
    if version == 1:
        return hashlib.sha256(_payload_encoder.encode((messages, tuple(tools)))).hexdigest()
    raise ValueError(
        f"recipe version {version} is not one this torpor knows (1 to {RECIPE_VERSION})"
    )


@lru_cache(maxsize=256)
def text_hash(text: str) -> str:
    """sha256 hex of a text (the system prompt, recorded in recipes); cached, prompts repeat."""
    return hashlib.sha256(text.encode()).hexdigest()
