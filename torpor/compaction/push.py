"""Task-conditioned retrieval, pushed: a bounded "recalled" section chosen before a call.

Design source 001 (section 4.1) scores an event for a context pack as
``base(e, q) * task_rel(e, task) * (1 - sup(e))`` and picks with Maximal
Marginal Relevance. Here, when a conversation has folded history:

* **candidates**: the store's search (the whole log, 0-1 scores, see
  :mod:`torpor.store.hits`) for the salient words of the current user message,
  and for those of the task card; only events the fold took out of context
  (positions before the checkpoint) and only what can say something (no task
  card events, which are in context anyway, and no output of an earlier
  ``recall`` or ``expand``, which only quotes other events);
* **second hop**: identifiers the three best candidates name that no query
  holds (a separator and a digit: ``OPS-4821``) are searched once more; what
  that finds has the hit's score times the best first-hop score as its base;
* **base**: the better of the event's store scores;
* **task relevance**: ``0.5 + 0.5 * coverage`` of the card's words in the event
  (1 without a card), so an event about the task outranks an equally good match
  that is not, and a match off the task still counts half;
* **supersession**: an event that sets a key (``NAME = value`` or ``NAME: value``,
  NAME identifier-shaped: a digit, ``_``, ``-``, ``.``, ``/`` or an inner capital
  in it) is superseded by a later candidate that sets the same key; it scores 0;
* **MMR**: greedily the candidate maximizing ``lam * score - (1 - lam) * max
  similarity`` (word-set Jaccard) to those already picked, until the budget;
* **prose corrections**: a pick that a later event corrects in plain language
  (:mod:`~torpor.compaction.corrections`) is listed with its corrections right after
  it (at its score), or not at all;
* the section lists each pick as ``#position kind: text`` (text clipped to a share
  of the budget), so the model can ``expand`` it; the whole section (framing
  included) never exceeds ``budget`` tokens.

Pull (``recall``/``expand``) stays; push only hands over what the task likely
needs first. :func:`recalled_block` is pure in (events, tokens kept): the audit
rebuilds the section from the positions a call recorded.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence

import msgspec

from torpor.compaction.corrections import corrections
from torpor.compaction.markers import common_word
from torpor.compaction.sections import Block
from torpor.compaction.slots import clip_text
from torpor.compaction.task_card import card_lines
from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_cached
from torpor.events import Event, TaskCard, kind_of, presented, searchable_text
from torpor.store.fulltext import coverage
from torpor.store.hits import left_out
from torpor.store.protocol import EventStore, SearchHit

__all__ = [
    "DEFAULT_LAMBDA",
    "DEFAULT_PUSH_TOKENS",
    "RECALLED_HEADER",
    "Candidate",
    "Pushed",
    "fact_keys",
    "mmr",
    "push",
    "query_words",
    "recalled_block",
]

DEFAULT_PUSH_TOKENS = 2_000
DEFAULT_LAMBDA = 0.7  # design source 001: stable for 0.5-0.8
CANDIDATES = 16  # hits asked of the store per query
ECHO_TOOLS = frozenset(("recall", "expand"))  # the built-in tools whose output quotes the log
HOP_FROM = 3  # the best first-hop candidates whose identifiers are followed
HOP_TERMS = 4  # identifiers in the second-hop query, at most
MAX_QUERY_WORDS = 24
RECALLED_HEADER = (
    "Recalled from earlier in this conversation for the current task "
    "(#position: expand(start, end) reads it in full):"
)

_WORD = re.compile(r"[\w][\w.\-/:@#]*[\w]|\w")
# Short function words and question filler (common_word covers the longer ones).
_SHORT_TEXT = """
    a an and are as at be but by can do for from how i if in is it its me my no not of
    on or our so than that the their them then there these they this to up us was we
    what when where which who why will with you your give tell find show please value
    did does get got put let use any all one has had
"""
_SHORT = frozenset(_SHORT_TEXT.split())
_IDENT = re.compile(r"(?<![\w\-])[A-Za-z][A-Za-z0-9]*(?:[\-_][A-Za-z0-9]+)+(?![\w\-])")
_KEY = re.compile(r"(?<![\w\-./])([A-Za-z_][\w\-./]*\w)\s*(?:=|:(?!//))(?=\s*\S)")


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """One candidate event and how it scored (``score``: the product, 0 when superseded)."""

    position: int
    base: float
    task: float
    superseded: bool
    score: float


class Pushed(msgspec.Struct, frozen=True, gc=False):
    """What push chose for one call: the section (None: nothing), positions and scores."""

    block: Block | None
    kept: tuple[tuple[int, int], ...] = ()  # (position, tokens of its text kept)
    scores: tuple[float, ...] = ()  # parallel to ``kept``
    candidates: tuple[Candidate, ...] = ()  # every candidate scored, best first


NOTHING = Pushed(None)


def query_words(text: str, limit: int = MAX_QUERY_WORDS) -> list[str]:
    """The salient words of a text as a query: exact strings (identifiers, paths, numbers)
    and prose words that are not common English, in order, once each."""
    out: list[str] = []
    seen: set[str] = set()
    for match in _WORD.finditer(text):
        word = match.group().strip(".:/-")
        low = word.lower()
        if not word or low in seen or low in _SHORT:
            continue
        plain = word.isalpha()
        if plain and (len(word) < 3 or common_word(word)):
            continue
        seen.add(low)
        out.append(word)
        if len(out) >= limit:
            break
    return out


def fact_keys(text: str) -> set[str]:
    """Keys an event sets (``NAME = value``, ``NAME: value``; NAME identifier-shaped)."""
    keys: set[str] = set()
    for match in _KEY.finditer(text):
        name = match.group(1)
        if any(c.isdigit() or c in "_-./" for c in name) or any(c.isupper() for c in name[1:]):
            keys.add(name.lower())
    return keys


def _words(text: str) -> frozenset[str]:
    return frozenset(w.lower() for w in _WORD.findall(text))


def _similarity(a: frozenset[str], b: frozenset[str]) -> float:
    if not a or not b:
        return 0.0
    return len(a & b) / len(a | b)


def mmr(
    scores: Sequence[float], words: Sequence[frozenset[str]], lam: float
) -> list[int]:
    """Indices in Maximal Marginal Relevance order (candidates scoring 0 left out)."""
    left = [i for i, s in enumerate(scores) if s > 0.0]
    picked: list[int] = []
    while left:
        best, best_value = left[0], float("-inf")
        for i in left:
            redundancy = max((_similarity(words[i], words[j]) for j in picked), default=0.0)
            value = lam * scores[i] - (1.0 - lam) * redundancy
            if value > best_value:
                best, best_value = i, value
        picked.append(best)
        left.remove(best)
    return picked


def _line(event: Event, text: str) -> str:
    return f"#{event.position} {kind_of(event.body)}: {text}"


def _text(event: Event) -> str:
    return " ".join(searchable_text(event.body).split())


def recalled_block(
    events: Sequence[Event], kept: Sequence[int], encoding: str
) -> Block | None:
    """The recalled section for ``events`` with ``kept[i]`` tokens of event i's text."""
    if not events:
        return None
    lines = [RECALLED_HEADER]
    for event, keep in zip(events, kept, strict=True):
        lines.append(_line(event, clip_text(_text(event), keep, encoding)))
    text = "\n".join(lines)
    return Block("recalled", text, count_cached(text, encoding) + MESSAGE_OVERHEAD)


async def push(
    store: EventStore,
    conversation_id: str,
    *,
    question: str,
    card: TaskCard | None,
    before: int,
    budget: int = DEFAULT_PUSH_TOKENS,
    lam: float = DEFAULT_LAMBDA,
    encoding: str,
    k: int = CANDIDATES,
) -> Pushed:
    """Choose the recalled section for a call (see the module doc); ``before``: the first
    position still in context (the checkpoint's), nothing at or after it is pushed."""
    card_query = " ".join(query_words(card_lines(card))) if card is not None else ""
    user_query = " ".join(query_words(question))
    queries = [q for q in (user_query, card_query) if q]
    if not queries or before <= 0:
        return NOTHING
    found = await asyncio.gather(*(store.search(conversation_id, q, k) for q in queries))
    base = _candidates(found, before)
    if not base:
        return NOTHING
    events = await _read(store, conversation_id, base)
    if not events:  # every hit was an echo of an earlier recall
        return NOTHING
    # The second hop: an identifier the best candidates name that no query asked for
    # ("see ticket OPS-4821") is searched once; what it finds scores its hit's score
    # times the best first-hop score.
    hop = _hop_query(events, base, queries)
    if hop:
        parent = max(base[e.position] for e in events)
        extra = _candidates([await store.search(conversation_id, hop, k)], before)
        new = {p: round(score * parent, 6) for p, score in extra.items() if p not in base}
        if new:
            base.update(new)
            events = sorted([*events, *await _read(store, conversation_id, new)],
                            key=_position)
    texts = [_text(e) for e in events]
    # Supersession among the candidates: the latest event setting a key owns it.
    owner: dict[str, int] = {}
    keys = [fact_keys(t) for t in texts]
    for i, ks in enumerate(keys):  # ascending positions: later ones overwrite
        for key in ks:
            owner[key] = i
    candidates: list[Candidate] = []
    for i, event in enumerate(events):
        task = 0.5 + 0.5 * coverage(texts[i], card_query) if card_query else 1.0
        superseded = any(owner[key] != i for key in keys[i])
        b = base[event.position]
        score = 0.0 if superseded else b * task
        candidates.append(Candidate(event.position, b, task, superseded, round(score, 6)))
    order = mmr([c.score for c in candidates], [_words(t) for t in texts], lam)
    # A fact corrected in prose ("Scratch that, use eu-north-1.") is shown with its
    # corrections right after it, or not at all: never the stale value alone.
    fixes = await corrections(store, conversation_id, (events[i].position for i in order))
    for chain in fixes.values():
        for fix in chain:
            if fix.position not in {e.position for e in events}:
                events.append(fix)
    index = {e.position: i for i, e in enumerate(events)}
    score_of = {events[i].position: candidates[i].score for i in order}
    cap = max(32, budget // 4)  # no single event takes the whole section
    chosen: list[int] = []
    kept: list[int] = []
    scores: list[float] = []
    spent = count_cached(RECALLED_HEADER, encoding) + MESSAGE_OVERHEAD
    for i in order:
        if i in chosen:
            continue  # shown already, as a correction
        group = [i, *(index[f.position] for f in fixes.get(events[i].position, ()))]
        group = [j for j in group if j == i or j not in chosen]
        keeps: list[int] = []
        room = budget - spent
        for j in group:
            keep = min(cap, room - 12, events[j].tokens + 8)  # 12: "#position kind: ", "\n"
            if keep < 8:
                break
            keeps.append(keep)
            room -= keep + 12
        if len(keeps) < len(group):
            break  # the section is full
        chosen.extend(group)
        kept.extend(keeps)
        scores.extend(score_of[events[i].position] for _ in group)
        spent = budget - room
    while chosen:
        block = recalled_block([events[i] for i in chosen], kept, encoding)
        if block is not None and block.tokens <= budget:
            break
        while True:  # a tokenizer surprise: give up the last pick rather than overrun
            chosen.pop()
            kept.pop()
            scores.pop()
            if not chosen or not _corrects_last(chosen, fixes, events):
                break
    else:
        return Pushed(None, candidates=tuple(sorted(candidates, key=_best)))
    return Pushed(
        block,
        tuple((events[i].position, keep) for i, keep in zip(chosen, kept, strict=True)),
        tuple(scores),
        tuple(sorted(candidates, key=_best)),
    )


def _corrects_last(chosen: list[int], fixes: dict[int, list[Event]], events: list[Event]) -> bool:
    """Whether the last pick has corrections that were just given up (so it goes too)."""
    return events[chosen[-1]].position in fixes


def _candidates(found: Sequence[Sequence[SearchHit]], before: int) -> dict[int, float]:
    """Position -> best store score of the hits a push may use (folded, not a card)."""
    base: dict[int, float] = {}
    for hits in found:
        for hit in hits:
            if hit.position < before and hit.kind != "task_card":
                base[hit.position] = max(base.get(hit.position, 0.0), hit.score)
    return base


async def _read(store: EventStore, conversation_id: str, positions: Iterable[int]) -> list[Event]:
    reads = await asyncio.gather(
        *(store.read_range(conversation_id, p, p) for p in sorted(positions))
    )
    return [presented(r[0]) for r in reads if r and not _echo(r[0])]


def _echo(event: Event) -> bool:
    """An earlier recall's or expand's output: copies of other events (which are candidates
    themselves), so not evidence; a stale value quoted there must not supersede a newer one.
    Nor a message that only calls them: its arguments are an earlier query."""
    return left_out(event.body, ECHO_TOOLS)


def _hop_query(events: Sequence[Event], base: dict[int, float], queries: Sequence[str]) -> str:
    """Identifiers (a separator and a digit: ``OPS-4821``, ``build_42``) that the three best
    candidates name and no query holds, as one query ("" when there are none)."""
    asked = " ".join(queries).lower()
    best = sorted(events, key=lambda e: (-base[e.position], e.position))[:HOP_FROM]
    found: list[str] = []
    for event in best:
        for match in _IDENT.finditer(_text(event)):
            word = match.group()
            if any(c.isdigit() for c in word) and word.lower() not in asked and word not in found:
                found.append(word)
    return " ".join(found[:HOP_TERMS])


def _position(event: Event) -> int:
    return event.position


def _best(candidate: Candidate) -> tuple[float, int]:
    return (-candidate.score, candidate.position)
