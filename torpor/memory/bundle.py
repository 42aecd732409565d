"""The memory bundle: the most salient episodes and standing facts, under its own budget.

Rendered into the compaction snapshot after the system prompt (and the task
card), before the markers (design source 002: system prompt, memory bundle,
last turns). Pure: the same items, budget and encoding give the same bytes, so
a revived agent and the audit see what a live one saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torpor.compaction.tokens import DEFAULT_ENCODING, count_text
from torpor.memory.ledger import surviving
from torpor.store.memory import EpisodicItem, LedgerEntry, SemanticItem

__all__ = [
    "BUNDLE_HEADER",
    "DEFAULT_BUNDLE_TOKENS",
    "episode_line",
    "fact_line",
    "importance",
    "render_bundle",
]

BUNDLE_HEADER = "Memory of the folded turns (derived from the log; recall() finds the events):"
DEFAULT_BUNDLE_TOKENS = 600
_SHORTEST_LINE = 6  # tokens of the shortest line a fact or an episode can render to


def importance(item: EpisodicItem | SemanticItem) -> float:
    """How much an item deserves a place: salience, times confidence for a fact."""
    if isinstance(item, SemanticItem):
        return item.salience * item.confidence
    return item.salience


def fact_line(item: SemanticItem) -> str:
    # One line per item, like an episode's: a line break in a stored text must not make a
    # fact look like a section of the bundle ("Episodes:") or a second entry.
    return f"- ({item.kind}) {' '.join(item.key.split())}: {' '.join(item.text.split())}"


def episode_line(item: EpisodicItem) -> str:
    text = " ".join(item.summary.split())
    return f"- [events {item.start}\u2013{item.end}] {text}"


def render_bundle(
    episodes: Sequence[EpisodicItem],
    facts: Sequence[SemanticItem],
    ledger: Iterable[LedgerEntry] = (),
    *,
    budget: int = DEFAULT_BUNDLE_TOKENS,
    encoding: str = DEFAULT_ENCODING,
) -> str:
    """The bundle's text ("" when there is nothing to show): standing facts and episodes,
    most important first while they fit in ``budget`` tokens, shown in log order."""
    standing = surviving(facts, ledger)
    candidates: list[tuple[float, int, tuple[int, int], str]] = []
    for fact in standing:
        candidates.append((importance(fact), 0, fact.order, fact_line(fact)))
    for episode in episodes:
        candidates.append((importance(episode), 1, (episode.position, 0), episode_line(episode)))
    # Most important first; ties: facts before episodes, newer before older.
    candidates.sort(key=lambda c: (-c[0], c[1], (-c[2][0], -c[2][1])))
    left = budget - count_text(BUNDLE_HEADER + "\nFacts:\nEpisodes:", encoding)
    chosen: list[tuple[float, int, tuple[int, int], str]] = []
    for candidate in candidates:
        if left < _SHORTEST_LINE:  # nothing else can fit: stop counting (O(chosen), not O(n))
            break
        cost = count_text(candidate[3], encoding) + 1
        if cost <= left:
            chosen.append(candidate)
            left -= cost
    if not chosen:
        return ""
    lines = [BUNDLE_HEADER]
    for section, title in ((0, "Facts:"), (1, "Episodes:")):
        picked = sorted((c for c in chosen if c[1] == section), key=lambda c: c[2])
        if picked:
            lines.append(title)
            lines.extend(c[3] for c in picked)
    return "\n".join(lines)
