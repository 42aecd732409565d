"""What a summarizer's answer holds: the handoff, the span's episode, the structured items.

The model is asked (see :data:`torpor.compaction.summarizer.DEFAULT_INSTRUCTIONS`)
for an ``EPISODE:`` section, a ``FACTS:`` list and an ``ITEMS:`` JSON list of
``{"kind", "key", "text", "confidence"}`` objects. Models return garbage at
times: an answer without a readable ``ITEMS:`` list still gives its episode
(``problem`` then says what was wrong, for a warning), and an item that does
not fit is left out alone, never failing the fold.
"""

from __future__ import annotations

import json
import math
import re

import msgspec

from torpor.store.memory import MAX_KEY_LENGTH, MEMORY_KINDS, MemoryKind
from torpor.text import repair_text

__all__ = ["Extraction", "ItemDraft", "parse_answer"]

_ITEMS = re.compile(r"^\s*ITEMS:\s*", re.MULTILINE)
_SECTION = re.compile(r"^\s*(EPISODE|FACTS):\s*", re.MULTILINE)
_KEY_CHARS = re.compile(r"[^\w.-]+")  # letters and digits of any script stay
_JSON = json.JSONDecoder()  # raw_decode: the list, and where it ends (prose may follow)
MAX_ITEMS = 64  # of one fold; more is a model rambling, not a span's facts


class ItemDraft(msgspec.Struct, frozen=True, gc=False):
    """One semantic item as the summarizer stated it (before the fold gives it an id)."""

    kind: MemoryKind
    key: str
    text: str
    confidence: float = 0.7


class Extraction(msgspec.Struct, frozen=True, gc=False):
    summary: str  # the handoff text: the answer without its ITEMS block
    episode: str  # the EPISODE section (the whole summary when there is none)
    items: tuple[ItemDraft, ...] = ()
    problem: str | None = None  # why items are missing or were dropped (None: all read)


def _section(summary: str, name: str) -> str:
    parts = _SECTION.split(summary)
    # split gives [before, name1, body1, name2, body2, ...]
    for i in range(1, len(parts) - 1, 2):
        if parts[i] == name:
            return parts[i + 1].strip()
    return ""


def normal_key(key: str) -> str:
    """Keys compare loosely: lowercase, words joined by dots (``"Deploy window"`` ->
    ``"deploy.window"``, ``"Срок деплоя"`` -> ``"срок.деплоя"``), so the same fact
    stated twice lands under one key."""
    key = _KEY_CHARS.sub(".", key.strip().lower()).strip(".")
    return key[:MAX_KEY_LENGTH]


def _draft(raw: object) -> ItemDraft | None:
    if not isinstance(raw, dict):
        return None
    kind = raw.get("kind", raw.get("type", "fact"))
    key = raw.get("key")
    text = raw.get("text", raw.get("fact"))
    confidence = raw.get("confidence", 0.7)
    if kind not in MEMORY_KINDS or not isinstance(key, str) or not isinstance(text, str):
        return None
    if isinstance(confidence, bool) or not isinstance(confidence, int | float):
        return None
    if not math.isfinite(confidence):
        return None
    key, text = normal_key(repair_text(key)), repair_text(text).strip()
    if not key or not text:
        return None
    return ItemDraft(kind, key, text, min(1.0, max(0.0, float(confidence))))


def _list_at(block: str) -> tuple[object, str] | str:
    """The first JSON list of ``block`` (fenced or not) and the text after it; or why
    there is none. Decoded with ``raw_decode``: a line after the list is no garbage."""
    rest = block.lstrip()
    if rest.startswith("```"):  # a fenced block: its first line names the language
        rest = rest.partition("\n")[2]
    start = rest.find("[")  # a few words may come first ("ITEMS: here they are")
    if start < 0:
        return "the ITEMS: block holds no JSON list"
    try:
        raw, end = _JSON.raw_decode(rest, start)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        return f"the ITEMS: list is not JSON: {str(exc)[:200]}"
    after = rest[end:].lstrip()
    return raw, after[3:] if after.startswith("```") else after


def parse_answer(answer: str) -> Extraction:
    """Split a summarizer's answer; never raises.

    The handoff is the answer without its ``ITEMS:`` list: what comes before it and
    after it (a model may put the list first, or add a line after it).
    """
    match = _ITEMS.search(answer)
    if match is None:
        summary = answer.strip()
        episode = _section(summary, "EPISODE") or summary
        return Extraction(summary, episode, problem="the answer has no ITEMS: list")
    found = _list_at(answer[match.end():])
    if isinstance(found, str):
        summary = answer[: match.start()].strip()
        return Extraction(summary, _section(summary, "EPISODE") or summary, problem=found)
    raw, after = found
    summary = "\n\n".join(p for p in (answer[: match.start()].strip(), after.strip()) if p)
    episode = _section(summary, "EPISODE") or summary
    if not isinstance(raw, list):
        return Extraction(summary, episode, problem="the ITEMS: block is not a list")
    drafts = [_draft(item) for item in raw[:MAX_ITEMS]]
    items = tuple(d for d in drafts if d is not None)
    dropped = len(raw) - len(items)
    if not dropped:
        return Extraction(summary, episode, items)
    problem = f"{dropped} of {len(raw)} items left out (unreadable or too many)"
    return Extraction(summary, episode, items, problem)
