"""Issue 8, item 7: a model answer over ``max_event_bytes`` is stored, never dropped.

Like a large tool result: the row keeps a preview, an artifact written in the
same transaction keeps the full text, search indexes the full text, and
``expand`` gives it back whole. Only answers that would not fit are clipped.
"""

from __future__ import annotations

import msgspec
import pytest
from store_backends import Backend

from torpor import EventTooLarge
from torpor.compaction.recall import expand
from torpor.events import Aborted, AssistantMessage, ToolCall, UserMessage, decode_body
from torpor.store.clip import PREVIEW_BYTES

MIB = 1024 * 1024


def long_text(size: int, needle: str) -> str:
    words = "the model kept talking about the build and its tests "
    body = (words * (size // len(words) + 1))[: size - len(needle) - 1]
    return body + " " + needle


async def test_an_assistant_answer_over_the_limit_goes_to_an_artifact(backend: Backend) -> None:
    text = long_text(2 * MIB, "zebra-needle-4711")
    answer = AssistantMessage(text, (ToolCall("call-1", "grep", {"pattern": "x"}),))
    async with backend.open() as store:
        await store.append("c", [UserMessage("tell me everything")])
        (stored,) = await store.append_events("c", [answer], turn=1)
        body = stored.body
        assert isinstance(body, AssistantMessage)
        assert body.artifact is not None and body.full_size == len(text.encode())
        assert body.tool_calls == answer.tool_calls  # the calls are kept whole
        assert len(body.text.encode()) < PREVIEW_BYTES + 200 and body.artifact in body.text
        assert body.text.startswith(text[:100])
        (read,) = await store.read_since("c", 1)
        assert read.body == body
        assert (await store.get_artifact(body.artifact)).decode() == text
        # found by a word only the full text holds, with a snippet around it
        (hit,) = await store.search("c", "zebra-needle-4711")
        assert hit.position == 1 and "zebra-needle-4711" in hit.snippet
        # expand gives the answer back whole
        (expanded,) = await expand(store, "c", 1, 1)
        assert expanded.body == msgspec.structs.replace(body, text=text)


async def test_an_aborted_partial_answer_over_the_limit_is_kept(backend: Backend) -> None:
    partial = long_text(MIB + 10, "okapi-needle-99")
    async with backend.open() as store:
        (stored,) = await store.append_events("c", [Aborted("cancelled", partial, "by user")])
        body = stored.body
        assert isinstance(body, Aborted) and body.artifact is not None
        assert (body.reason, body.detail, body.full_size) == ("cancelled", "by user", len(partial))
        assert [h.position for h in await store.search("c", "okapi-needle-99")] == [0]
        (expanded,) = await expand(store, "c", 0, 0)
        assert isinstance(expanded.body, Aborted) and expanded.body.partial_text == partial


async def test_answers_that_fit_stay_verbatim(backend: Backend) -> None:
    text = long_text(MIB - 4096, "fits")
    async with backend.open() as store:
        (stored,) = await store.append_events("c", [AssistantMessage(text)])
        assert stored.body == AssistantMessage(text)
        (stored,) = await store.append_events("c", [Aborted("crashed", text)])
        assert stored.body == Aborted("crashed", text)


async def test_what_cannot_be_clipped_is_still_refused(backend: Backend) -> None:
    huge_arguments = {"blob": "x" * (MIB + 1)}
    async with backend.open() as store:
        with pytest.raises(EventTooLarge):  # caller input
            await store.append("c", [UserMessage("x" * (MIB + 1))])
        with pytest.raises(EventTooLarge):  # the calls are not clipped
            await store.append("c", [AssistantMessage("hi", (ToolCall("i", "t", huge_arguments),))])
        assert await store.head("c") is None


def test_rows_written_before_the_new_fields_still_decode() -> None:
    class OldAssistant(msgspec.Struct, tag="assistant"):
        text: str
        tool_calls: tuple[ToolCall, ...] = ()

    class OldAborted(msgspec.Struct, tag="aborted"):
        reason: str
        partial_text: str = ""
        detail: str = ""

    old = msgspec.msgpack.encode(OldAssistant("hello", (ToolCall("i", "t", {}),)))
    assert decode_body(old, conversation_id="c", position=0) == AssistantMessage(
        "hello", (ToolCall("i", "t", {}),)
    )
    old = msgspec.msgpack.encode(OldAborted("cancelled", "partial", "why"))
    assert decode_body(old, conversation_id="c", position=0) == Aborted(
        "cancelled", "partial", "why"
    )
