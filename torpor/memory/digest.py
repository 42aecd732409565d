"""The bounded digest (design source 001, section 8.5): a pure function of the standing
facts and the episode summaries, at most ``max_lines`` lines.

Every standing fact and every episode is one one-line entry. When they do not
all fit, the least important are *demoted* to linked detail: the last line says
how many more there are and where to expand them (``memory:<conversation>``,
which :meth:`torpor.Runtime.memory` reads), and :attr:`Digest.demoted` holds
them. Nothing is dropped, and nothing is written anywhere: the caller decides.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from torpor.errors import InvalidInput
from torpor.memory.bundle import episode_line, fact_line, importance
from torpor.store.memory import EpisodicItem, SemanticItem

__all__ = ["Digest", "write_digest"]

_LINE_CHARS = 200  # an entry is one line: longer summaries are cut there


class Digest(msgspec.Struct, frozen=True, gc=False):
    lines: tuple[str, ...]  # at most max_lines
    demoted: tuple[tuple[str, str], ...] = ()  # (item id, its line), least important last
    link: str = ""  # where the demoted entries expand

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _LINE_CHARS else text[: _LINE_CHARS - 1] + "\u2026"


def write_digest(
    facts: Sequence[SemanticItem],
    episodes: Sequence[EpisodicItem],
    max_lines: int,
    *,
    link: str = "memory",
) -> Digest:
    """``facts`` (the standing ones) and ``episodes`` as at most ``max_lines`` lines.

    Shown entries keep log order (facts first, then episodes); when some must be
    demoted, one line of the bound is spent on "…and N more: expand <link>".
    """
    if type(max_lines) is not int or max_lines < 1:
        raise InvalidInput("max_lines", f"must be an int >= 1, got {max_lines!r}")
    entries: list[tuple[float, int, tuple[int, int], str, str]] = [
        (importance(f), 0, f.order, f.id, _one_line(fact_line(f))) for f in facts
    ]
    entries += [(importance(e), 1, (e.position, 0), e.id, _one_line(episode_line(e)))
                for e in episodes]
    if len(entries) <= max_lines:
        entries.sort(key=lambda e: (e[1], e[2]))
        return Digest(tuple(e[4] for e in entries), link=link)
    # Most important first (ties: facts, then newer); the tail is demoted, not dropped.
    ranked = sorted(entries, key=lambda e: (-e[0], e[1], (-e[2][0], -e[2][1])))
    shown, demoted = ranked[: max_lines - 1], ranked[max_lines - 1 :]
    shown.sort(key=lambda e: (e[1], e[2]))
    lines = [e[4] for e in shown]
    lines.append(_one_line(f"\u2026and {len(demoted)} more: expand {link}"))  # a link too
    return Digest(tuple(lines), tuple((e[3], e[4]) for e in demoted), link)
