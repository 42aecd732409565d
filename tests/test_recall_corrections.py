"""Prose corrections rank with, and come back beside, what they correct (issue 25, item 2),
in recall and in push, on SQLite (in memory and on file) and PostgreSQL alike."""

from __future__ import annotations

from recall_traces import topical_conversation
from store_backends import AnyStore

from torpor.compaction.corrections import corrects
from torpor.compaction.push import push
from torpor.compaction.recall import recall
from torpor.compaction.tokens import DEFAULT_ENCODING
from torpor.events import Body, UserMessage

OLD = "The payments service is going to ap-northeast-1."
FIX = "Scratch that, use eu-north-1."


async def _conversation(store: AnyStore, events: int, facts: dict[int, Body]) -> None:
    for turn in topical_conversation(events, facts):
        await store.append("c", turn)


async def test_deploying_payments_returns_the_correction_first_beside_the_old_fact(
    store: AnyStore,
) -> None:
    await _conversation(store, 120, {40: UserMessage(OLD), 44: UserMessage(FIX)})
    hits = await recall(store, "c", "deploying payments", k=10)
    assert [h.position for h in hits[:2]] == [44, 40]
    assert "eu-north-1" in hits[0].snippet and "ap-northeast-1" in hits[1].snippet
    assert hits[0].score == hits[1].score > 0
    assert [h.position for h in hits].count(44) == 1
    plain = await recall(store, "c", "deploying payments", k=10, follow_corrections=False)
    assert 44 not in {h.position for h in plain}


async def test_a_correction_outside_the_window_or_about_something_else_is_not_one(
    store: AnyStore,
) -> None:
    facts: dict[int, Body] = {
        40: UserMessage(OLD),
        42: UserMessage("Actually, the retry timeout should be 30 seconds instead."),
        80: UserMessage(FIX),  # twenty turns on: not about the payments line any more
    }
    await _conversation(store, 120, facts)
    hits = await recall(store, "c", "deploying payments", k=10)
    assert hits[0].position == 40
    assert not {42, 80} & {h.position for h in hits}


async def test_push_never_shows_the_superseded_fact_without_its_correction(
    store: AnyStore,
) -> None:
    await _conversation(store, 120, {40: UserMessage(OLD), 44: UserMessage(FIX)})
    pushed = await push(store, "c", question="Where are we deploying payments?", card=None,
                        before=100, encoding=DEFAULT_ENCODING)
    positions = [p for p, _ in pushed.kept]
    assert 40 in positions
    assert positions[positions.index(40) + 1] == 44  # the correction right after it
    assert pushed.block is not None and "eu-north-1" in pushed.block.text


def test_what_counts_as_a_prose_correction() -> None:
    assert corrects(FIX, OLD)
    assert corrects("Actually, payments go to eu-west-2 instead.", OLD)
    assert corrects("Actually, make that Priya Raman.", "The cutover is owned by Dana Whitfield.")
    assert corrects("Dana no longer owns the billing cutover.",
                    "The billing cutover is owned by Dana Whitfield.")
    assert not corrects("Use eu-north-1 for the new cluster.", OLD)  # no marker
    assert not corrects("Actually, the timeout should be 30 seconds instead.", OLD)
    assert not corrects("Scratch that, use eu-north-1.", "The billing cutover is owned by Dana.")
