"""What a chaos run left in PostgreSQL, checked against what clients were told.

* every acknowledged message is in its conversation's log exactly once (``lost``,
  ``duplicated``; no user text at all appears twice, acknowledged or not);
* positions are dense (0..n-1, and the conversation's head is n-1);
* along each conversation's positions, the epoch that wrote a row never goes down,
  no row lacks one, and none is above its shard's lease epoch now; the row's shard is
  the conversation's;
* no conversation is parked (a ``parked`` event without a later ``unparked``);
* every turn that holds a user message ended (an answer without tool calls, an abort or
  a suspension): ``unended_turns``, and ``unended_last_turns`` for the conversations
  whose last turn is open (nothing left hanging).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import asyncpg

from torpor.cluster import shard_of
from torpor.events import AssistantMessage, Parked, Unparked, UserMessage, decode_body

__all__ = ["check", "unended"]

_EVENTS = """
SELECT c.external_id, c.shard, c.head, e.position, e.turn, e.kind, e.epoch, e.body
FROM events e JOIN conversations c ON c.key = e.conversation_id
ORDER BY c.key, e.position
"""
_ENDS = ("aborted", "suspended")


def _open_turns(rows: list[asyncpg.Record]) -> dict[str, list[int]]:
    """Per conversation, the turns with a user message and no end, in log order."""
    users: dict[str, dict[int, None]] = defaultdict(dict)
    ended: set[tuple[str, int]] = set()
    for r in rows:
        cid, turn, kind = r[0], r[4], r[5]
        if kind == "user":
            users[cid][turn] = None
        elif kind in _ENDS:
            ended.add((cid, turn))
        elif kind == "assistant":
            body = decode_body(r[7], conversation_id=cid, position=r[3])
            if isinstance(body, AssistantMessage) and not body.tool_calls:
                ended.add((cid, turn))
    return {cid: [t for t in turns if (cid, t) not in ended]
            for cid, turns in users.items() if any((cid, t) not in ended for t in turns)}


async def unended(db: str) -> dict[str, list[int]]:
    """The turns no event ended yet, by conversation."""
    conn = await asyncpg.connect(db)
    try:
        rows = await conn.fetch(_EVENTS)
    finally:
        await conn.close()
    return _open_turns(rows)


async def check(db: str, acked: dict[str, str], shards: int) -> dict[str, Any]:
    conn = await asyncpg.connect(db)
    try:
        rows = await conn.fetch(_EVENTS)
        lease_epochs = dict(await conn.fetch("SELECT shard, epoch FROM shard_leases"))
    finally:
        await conn.close()
    texts: dict[str, Counter[str]] = defaultdict(Counter)
    positions: dict[str, list[int]] = defaultdict(list)
    heads: dict[str, int] = {}
    last_epoch: dict[str, int] = {}
    parked: dict[str, bool] = {}
    epoch_regressions: list[Any] = []
    null_epochs = above_lease = wrong_shard = 0
    for cid, shard, head, position, _turn, kind, epoch, raw in rows:
        positions[cid].append(position)
        heads[cid] = head
        if shard != shard_of(cid, shards):
            wrong_shard += 1
        if epoch is None:
            null_epochs += 1
        else:
            if epoch < last_epoch.get(cid, 0):
                epoch_regressions.append((cid, position, last_epoch[cid], epoch))
            last_epoch[cid] = max(epoch, last_epoch.get(cid, 0))
            if epoch > lease_epochs.get(shard, 0):
                above_lease += 1
        if kind in ("user", "parked", "unparked"):
            body = decode_body(raw, conversation_id=cid, position=position)
            if isinstance(body, UserMessage):
                texts[cid][body.text] += 1
            elif isinstance(body, Parked):
                parked[cid] = True
            elif isinstance(body, Unparked):
                parked[cid] = False
    lost = [(cid, text) for text, cid in acked.items() if texts[cid][text] == 0]
    duplicated = [(cid, text, n) for cid, counter in texts.items()
                  for text, n in counter.items() if n > 1]
    not_dense = [cid for cid, ps in positions.items()
                 if ps != list(range(len(ps))) or heads[cid] != len(ps) - 1]
    open_turns = _open_turns(rows)
    last_turn = {r[0]: r[4] for r in rows if r[5] == "user"}  # the last user turn
    return {
        "conversations": len(positions), "events": len(rows),
        "acknowledged": len(acked), "found": len(acked) - len(lost),
        "lost": len(lost), "duplicated": len(duplicated), "not_dense": len(not_dense),
        "epoch_regressions": len(epoch_regressions), "null_epochs": null_epochs,
        "epochs_above_lease": above_lease, "wrong_shard": wrong_shard,
        "parked": sum(parked.values()),
        "unended_turns": sum(map(len, open_turns.values())),
        "unended_last_turns": sum(1 for cid, ts in open_turns.items()
                                  if last_turn.get(cid) in ts),
        "examples": {"lost": lost[:5], "duplicated": duplicated[:5], "not_dense": not_dense[:5],
                     "epoch_regressions": epoch_regressions[:5],
                     "parked": [c for c, p in parked.items() if p][:5],
                     "unended": dict(list(open_turns.items())[:5])},
    }
