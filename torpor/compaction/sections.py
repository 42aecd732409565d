"""The order of a rendered context, in one place.

A context is, in this order:

1. the system prompt;
2. the head blocks, in :data:`HEAD_ORDER`: the task card (never folded or
   stubbed), then the fold's handoff (the memory bundle a fold kept, then the
   pointer markers and any summary: one block, see
   :func:`~torpor.compaction.markers.handoff_text`);
3. the tail: the verbatim turns since the fold, stubbed and clipped by the
   reducers;
4. the recalled section (task-conditioned push, :mod:`torpor.compaction.push`).

Everything before the tail changes only when the card changes or at a fold, so a
provider's prefix cache keeps it. The recalled section is chosen again for each
user message, so it goes *after* the tail: placed before it, every new recalled
set would change the prefix from there on and void the cached tail on every turn;
at the end it costs the cache only itself.

A new head block is one more name in :data:`HEAD_ORDER` and one more entry in
the mapping given to :func:`head_of` (by the working set and by the audit's
rebuild).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = ["HEAD_ORDER", "Block", "head_of", "head_tokens"]

HEAD_ORDER: tuple[str, ...] = ("task_card", "markers")
"""Head blocks after the system prompt, in rendering order (each a ``sections`` key)."""


class Block(NamedTuple):
    """One system block of the context: its ``sections`` name, text and token cost."""

    name: str
    text: str
    tokens: int


def head_of(blocks: Mapping[str, tuple[str, int]]) -> tuple[Block, ...]:
    """The head blocks that render something, in :data:`HEAD_ORDER`."""
    head: list[Block] = []
    for name in HEAD_ORDER:
        block = blocks.get(name)
        if block is not None and block[0]:
            head.append(Block(name, block[0], block[1]))
    return tuple(head)


def head_tokens(head: Sequence[Block]) -> int:
    return sum(block.tokens for block in head)
