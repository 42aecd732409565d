"""The memory section of ``torpor inspect``: episodic and semantic items, the ledger, the
turns a reconciler skipped, and the digest, read from the store (no agent woken)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torpor.cli.common import to_jsonable
from torpor.cli.render import clip
from torpor.memory.digest import write_digest
from torpor.memory.ledger import surviving
from torpor.store.protocol import EventStore

__all__ = ["memory_json", "print_memory"]

_DIGEST_LINES = 40


async def memory_json(store: EventStore, conversation_id: str) -> dict[str, Any]:
    record = await store.memory(conversation_id)
    standing = surviving(record.facts, record.ledger)
    ids = {f.id for f in standing}
    digest = write_digest(standing, record.episodes, _DIGEST_LINES,
                          link=f"memory:{conversation_id}")
    return {
        "episodes": [{"id": e.id, **to_jsonable(e)} for e in record.episodes],
        "facts": [{"id": f.id, "standing": f.id in ids, **to_jsonable(f)} for f in record.facts],
        "ledger": [to_jsonable(e) for e in record.ledger],
        "skipped_turns": list(record.skipped_turns),
        "digest": list(digest.lines),
    }


def _plain(*cells: str) -> list[str]:
    # A model's text is not markup: "[/]" would end the command, "[red]" would vanish.
    return [escape(cell) for cell in cells]


def print_memory(console: Console, data: dict[str, Any]) -> None:
    if not (data["episodes"] or data["facts"] or data["ledger"] or data["skipped_turns"]):
        return
    if data["episodes"]:
        table = Table(title="memory: episodes (one per fold)")
        for name in ("events", "turns", "salience", "summary"):
            table.add_column(name)
        for e in data["episodes"]:
            turns = e["turns"]
            span = f"{turns[0]}-{turns[-1]}" if turns else "-"
            table.add_row(*_plain(f"{e['start']}-{e['end']}", span, f"{e['salience']:.2f}",
                                  clip(" ".join(e["summary"].split()), 80)))
        console.print(table)
    if data["facts"]:
        table = Table(title="memory: semantic items")
        for name in ("id", "kind", "key", "confidence", "standing", "text"):
            table.add_column(name)
        for f in data["facts"]:
            table.add_row(*_plain(f["id"], f["kind"], f["key"], f"{f['confidence']:.2f}",
                                  "yes" if f["standing"] else "no", clip(f["text"], 60)))
        console.print(table)
    if data["ledger"]:
        table = Table(title="memory: ledger (latest per key plus a bounded tail)")
        for name in ("seq", "key", "action", "item", "supersedes", "reason"):
            table.add_column(name)
        for d in data["ledger"]:
            table.add_row(*_plain(str(d["seq"]), d["key"], d["action"], d["item"],
                                  ", ".join(d["superseded"]) or "-", clip(d["reason"], 40)))
        console.print(table)
    if data["skipped_turns"]:
        turns = ", ".join(str(t) for t in data["skipped_turns"])
        console.print(f"turns a reconciler left out of memory (NONE): {turns}")
