"""Issue 8, items 5 and 10: every backend refuses the same input the same way, before writing.

Ids and text the log cannot hold (NUL, lone surrogates), bodies of the wrong
shape, and absurd positions, limits and turns raise InvalidInput on SQLite and
PostgreSQL alike; odd search queries return hits or nothing on both; no raw
driver error, OverflowError or UnicodeEncodeError leaks out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from store_backends import Backend

from torpor import InvalidInput, UnknownArtifact
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Suspended,
    TaskCard,
    ToolCall,
    ToolResult,
    Unparked,
    UserMessage,
)
from torpor.store import Checkpoint, EventStore, Marker, ModelCall

SURROGATE = "\ud800"
BAD_IDS: list[object] = ["", "x" * 257, None, 7, b"bytes", "nul\x00", f"lone{SURROGATE}"]


def call(**fields: Any) -> ModelCall:
    base: dict[str, Any] = dict(
        conversation_id="c",
        turn=1,
        call_index=0,
        compaction_cycle=0,
        recipe=b"",
        rendered_hash="h",
        sections={"tail": 1},
        estimated_prompt_tokens=1,
        utilization=0.1,
    )
    base.update(fields)
    return ModelCall(**base)


async def test_bad_conversation_ids_are_invalid_input_everywhere(backend: Backend) -> None:
    async with backend.open() as store:
        for bad in BAD_IDS:
            await _refuse_id(store, bad)
        assert await store.conversations() == []


async def _refuse_id(store: EventStore, bad: Any) -> None:
    attempts: list[Callable[[], Awaitable[object]]] = [
        lambda: store.append(bad, [UserMessage("a")]),
        lambda: store.append_events(bad, [UserMessage("a")]),
        lambda: store.read_since(bad, 0),
        lambda: store.read_range(bad, 0, 1),
        lambda: store.page_backward(bad),
        lambda: store.resume(bad),
        lambda: store.head(bad),
        lambda: store.search(bad, "a"),
        lambda: store.conversation(bad),
        lambda: store.checkpoints(bad),
        lambda: store.latest_checkpoint(bad),
        lambda: store.model_calls(bad),
        lambda: store.put_artifact(bad, b"x"),
        lambda: store.put_checkpoint(Checkpoint(bad, 0, 0, 1)),
        lambda: store.record_model_call(call(conversation_id=bad)),
    ]
    for index, attempt in enumerate(attempts):
        with pytest.raises(InvalidInput):
            await attempt()
            raise AssertionError(f"attempt {index} took {bad!r}")


async def test_bad_keys_cursors_and_artifact_ids_are_invalid_input(backend: Backend) -> None:
    async with backend.open() as store:
        for bad in BAD_IDS:
            if bad is None:  # no key, no cursor: fine
                continue
            with pytest.raises(InvalidInput):
                await store.append("c", [UserMessage("a")], key=bad)
            with pytest.raises(InvalidInput):
                await store.get_artifact(bad)
            if not isinstance(bad, str) or "\x00" in bad or SURROGATE in bad:  # cursors: text
                for attempt in (store.conversations(after=bad), store.pending(after=bad)):
                    with pytest.raises(InvalidInput):
                        await attempt
        assert await store.conversations() == []


def _bad_bodies() -> list[tuple[str, Body]]:
    nul, lone = "a\x00b", f"a{SURROGATE}b"
    cases: list[tuple[str, Body]] = []
    for name, bad in (("nul", nul), ("surrogate", lone)):
        cases += [
            (f"user text {name}", UserMessage(bad)),
            (f"assistant text {name}", AssistantMessage(bad)),
            (f"call id {name}", AssistantMessage("", (ToolCall(bad, "t"),))),
            (f"call name {name}", AssistantMessage("", (ToolCall("i", bad),))),
            (f"argument {name}", AssistantMessage("", (ToolCall("i", "t", {"p": bad}),))),
            (f"nested argument {name}", AssistantMessage("", (ToolCall("i", "t", {"p": [{"q": bad}]}),))),  # noqa: E501
            (f"argument key {name}", AssistantMessage("", (ToolCall("i", "t", {bad: 1}),))),
            (f"result call id {name}", ToolResult(bad, "t", "ok")),
            (f"result tool {name}", ToolResult("i", bad, "ok")),
            (f"result content {name}", ToolResult("i", "t", bad)),
            (f"suspended call id {name}", Suspended((bad,))),
            (f"suspended reason {name}", Suspended(("i",), bad)),
            (f"suspended tool {name}", Suspended(("i",), "", (bad,))),
            (f"resolved {name}", Resolved(bad)),
            (f"partial text {name}", Aborted("cancelled", bad)),
            (f"abort detail {name}", Aborted("crashed", "", bad)),
            (f"parked {name}", Parked(bad)),
            (f"unparked {name}", Unparked(bad)),
        ]
    return [
        *cases,
        ("text not a str", UserMessage(5)),  # type: ignore[arg-type]
        ("empty call id", ToolResult("", "t", "ok")),
        ("unknown abort reason", Aborted("bored")),  # type: ignore[arg-type]
        ("argument not json", AssistantMessage("", (ToolCall("i", "t", {"p": object()}),))),
        ("argument int too big", AssistantMessage("", (ToolCall("i", "t", {"p": 2**70}),))),
        ("tools not parallel", Suspended(("a", "b"), "", ("only-one",))),
        ("not a body", "just text"),  # type: ignore[list-item]
    ]


BAD_BODIES = _bad_bodies()


async def test_bodies_the_log_cannot_hold_are_refused_and_nothing_is_written(
    backend: Backend,
) -> None:
    async with backend.open() as store:
        for case, body in BAD_BODIES:
            with pytest.raises(InvalidInput) as caught:
                await store.append("c", [UserMessage("fine"), body])
            assert caught.value.what.startswith("events[1]"), case
            with pytest.raises(InvalidInput):
                await store.append_events("c", [body], key="k")
        assert await store.head("c") is None
        assert await store.conversations() == []
        # the same conversation still takes good input, from position 0
        assert await store.append("c", [UserMessage("fine")], key="k") == [0]


async def test_absurd_numbers_are_invalid_input_never_overflow(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("a")])
        huge, negative = 2**70, -1
        attempts: list[Awaitable[object]] = [
            store.read_since("c", huge),
            store.read_since("c", negative),
            store.read_since("c", True),  # a bool is not a position
            store.read_since("c", 1.0),  # type: ignore[arg-type]
            store.read_range("c", 0, huge),
            store.read_range("c", negative, 3),
            store.page_backward("c", before=huge),
            store.page_backward("c", before=negative),
            store.page_backward("c", limit=0),
            store.page_backward("c", limit=negative),
            store.page_backward("c", limit=huge),
            store.page_backward("c", limit=True),
            store.search("c", "a", k=huge),
            store.search("c", "a", k=0),
            store.search("c", "a", k=False),
            store.search("c", None),  # type: ignore[arg-type]
            store.model_calls("c", turn=huge),
            store.model_calls("c", limit=huge),
            store.conversations(limit=huge),
            store.conversations(limit=0),
            store.pending(limit=huge),
            store.pending(limit=negative),
            store.append("c", [UserMessage("b")], turn=huge),
            store.append("c", [UserMessage("b")], turn=True),
            store.append("c", [UserMessage("b")], turn=negative),
            store.append("c", [UserMessage("b")], expect_head=huge),
            store.append("c", [UserMessage("b")], expect_head=-2),
            store.append("c", "not a list"),  # type: ignore[arg-type]
            store.append("c", []),
            store.put_checkpoint(Checkpoint("c", huge, 0, 1)),
            store.put_checkpoint(Checkpoint("c", 0, 0, 1, summary=SURROGATE)),
            store.put_checkpoint(Checkpoint("c", 0, 0, 1, (Marker(0, huge, 0, 0),))),
            store.put_checkpoint(Checkpoint("c", 5, 0, 1)),  # beyond the head
            store.append("c", [TaskCard(goal=SURROGATE)]),
            store.append("c", [TaskCard(key_positions=(-1,))]),
            store.append("c", [TaskCard(constraints=("ok", "nul\x00"))]),
            store.put_checkpoint(Checkpoint(
                "c", 0, 0, 1, task_card=Event("c", 0, 0, 1, 0, UserMessage("not a card")))),
            store.put_checkpoint(Checkpoint(
                "c", 0, 0, 1, task_card=Event("c", 0, 0, 1, 0, TaskCard(goal=SURROGATE)))),
            store.record_model_call(call(turn=huge)),
            store.record_model_call(call(call_index=2**40)),
            store.record_model_call(call(reported_prompt_tokens=huge)),
            store.record_model_call(call(sections={"tail": huge})),
            store.record_model_call("not a call"),  # type: ignore[arg-type]
            store.put_artifact("c", "not bytes"),  # type: ignore[arg-type]
        ]
        for index, attempt in enumerate(attempts):
            try:
                await attempt
            except InvalidInput:
                continue
            raise AssertionError(f"attempt {index} did not raise InvalidInput")
        assert [e.position for e in await store.read_since("c", 0)] == [0]
        assert await store.checkpoints("c") == []
        assert await store.model_calls("c") == []


async def test_the_largest_accepted_numbers_work(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("a")], turn=2**31 - 1)
        assert await store.read_since("c", 2**32) == []
        assert await store.read_range("c", 0, 2**32) != []
        assert len(await store.page_backward("c", before=2**32, limit=2**31 - 1)) == 1
        assert await store.search("c", "a", k=2**31 - 1) != []


ODD_QUERIES = [
    "a\x00b",
    "\x00",
    SURROGATE,
    f"alpha{SURROGATE}beta",
    "",
    "   ",
    '"',
    '"alpha',
    "NEAR(alpha beta)",
    "alpha*",
    "alpha OR",
    "AND",
    "-alpha",
    "alpha:beta",
    "(alpha",
    "'alpha'",
    "\\",
    "!!! ???",
    "alpha " * 5000,
    "x" * 100_000,
    "\ufffd",
    "é" * 300,
]


async def test_odd_queries_return_hits_or_nothing_on_both_backends(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("alpha beta"), UserMessage("gamma")])
        for query in ODD_QUERIES:
            hits = await store.search("c", query)
            assert isinstance(hits, list)
            assert all(hit.position in (0, 1) for hit in hits), query[:20]


async def test_nul_and_surrogates_in_a_query_separate_words(backend: Backend) -> None:
    async with backend.open() as store:
        await store.append("c", [UserMessage("alpha"), UserMessage("beta"), UserMessage("zeta")])
        for query in ("alpha\x00beta", f"alpha{SURROGATE}beta"):
            assert sorted(hit.position for hit in await store.search("c", query)) == [0, 1]


async def test_missing_artifacts_and_bad_audit_text(backend: Backend) -> None:
    async with backend.open() as store:
        with pytest.raises(UnknownArtifact) as caught:
            await store.get_artifact("art-none")
        assert isinstance(caught.value, KeyError) and "art-none" in str(caught.value)
        # the audit's free text (a provider's error) is repaired, never a reason to fail
        await store.append("c", [UserMessage("x")])  # only an append creates a conversation
        await store.record_model_call(call(error=f"bad {SURROGATE} \x00 text", model="m\x00"))
        (stored,) = await store.model_calls("c")
        assert stored.error == "bad \ufffd \ufffd text" and stored.model == "m\ufffd"


async def test_both_backends_implement_the_whole_protocol(backend: Backend) -> None:
    async with backend.open() as store:
        assert isinstance(store, EventStore)


async def test_concurrent_bad_and_good_appends_share_nothing(backend: Backend) -> None:
    async with backend.open() as store:
        outcomes = await asyncio.gather(
            store.append("a", [UserMessage("one")]),
            store.append("b", [UserMessage(f"bad {SURROGATE}")]),
            store.append("a", [UserMessage("two")]),
            return_exceptions=True,
        )
        assert outcomes[0] == [0] and outcomes[2] == [1]
        assert isinstance(outcomes[1], InvalidInput)
        assert [c.conversation_id for c in await store.conversations()] == ["a"]


@pytest.mark.parametrize(
    ("text", "index"),
    [
        ("plain ascii", None),
        ("accents é and emoji \U0001f600", None),
        ("ascii\x00nul", 5),
        ("é\x00 nul after non-ascii", 1),
        (f"é{SURROGATE}", 1),
        (f"{SURROGATE}\udc00", 0),  # two halves are two lone surrogates, not a pair
    ],
)
def test_text_checks_agree_on_ascii_and_wider_text(text: str, index: int | None) -> None:
    """ASCII text is settled without the pattern (no surrogate can be in it); the rest by it:
    both ways find the same characters, and joined texts hold what their parts hold."""
    from torpor.text import check_text, is_storable, repair_text

    assert is_storable(text) is (index is None)
    assert is_storable("".join(("ok", text, "ok"))) is (index is None)
    if index is None:
        assert check_text(text, "t") is text and repair_text(text) is text
    else:
        with pytest.raises(InvalidInput, match=f"at index {index}"):
            check_text(text, "t")
        assert is_storable(repair_text(text)) and repair_text(text)[index] == "\ufffd"
